"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/responses,
/v1/conversations, /v1/models.

Streaming responses are server-sent events.  The request is aborted in the engine the
moment its client goes away: the server runs with handler cancellation, so the handler
is cancelled on disconnect and the generator's finally block sends the abort.
"""

from __future__ import annotations

import time

from aiohttp import web

from service.anthropic_api import MessagesServing
from service.http_util import json_response
from service.openai_completions import CompletionServing
from service.openai_conversations import ConversationsServing
from service.openai_responses import ResponsesServing


class OpenAIServing(ResponsesServing, MessagesServing, ConversationsServing, CompletionServing):
    """The OpenAI-compatible routes of one loaded model.  Chat (`service/openai_chat.py`),
    responses (`service/openai_responses.py`, chat turns answered in the Responses API's
    shape) and completions (`service/openai_completions.py`) share `ServingBase`
    (`service/openai_common.py`): queueing, bounded SSE writes, usage and logprob text."""

    async def models(self, request: web.Request) -> web.Response:
        now = int(time.time())
        return json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": now,
                        "owned_by": "pagestream",
                        "root": str(self.engine.model_dir),
                        "max_model_len": self.engine.max_model_len,
                    }
                    for name in self.names
                ]
                + [
                    {
                        "id": name,
                        "object": "model",
                        "created": now,
                        "owned_by": "pagestream",
                        # vLLM's shape for an adapter: its directory, and the base it adapts
                        "root": path,
                        "parent": self.names[0],
                        "max_model_len": self.engine.max_model_len,
                    }
                    for name, path in self.engine.lora_paths.items()
                ],
            }
        )
