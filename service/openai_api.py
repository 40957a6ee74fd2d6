"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/responses,
/v1/conversations, /v1/models.

Streaming responses are server-sent events.  The request is aborted in the engine the
moment its client goes away: the server runs with handler cancellation, so the handler
is cancelled on disconnect and the generator's finally block sends the abort.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from aiohttp import web

from service.anthropic_api import MessagesServing
from service.http_util import json_response
from service.openai_completions import CompletionServing
from service.openai_conversations import ConversationsServing
from service.openai_embeddings import PairwiseServing
from service.openai_responses import ResponsesServing
from service.protocol import BadRequest


class OpenAIServing(
    ResponsesServing, MessagesServing, ConversationsServing, PairwiseServing, CompletionServing
):
    """The OpenAI-compatible routes of one loaded model.  Chat (`service/openai_chat.py`),
    responses (`service/openai_responses.py`, chat turns answered in the Responses API's
    shape) and completions (`service/openai_completions.py`) share `ServingBase`
    (`service/openai_common.py`): queueing, bounded SSE writes, usage and logprob text."""

    def model_entries(self) -> list[dict[str, object]]:
        """Every name a request may give as `model`: OpenAI's model object with
        Anthropic's fields too (`type`, `display_name`, `created_at`), so either SDK reads
        it; an adapter in vLLM's shape (its directory, and the base it adapts)."""
        now = int(time.time())
        stamp = datetime.fromtimestamp(now, UTC).isoformat().replace("+00:00", "Z")

        def entry(name: str, **extra: object) -> dict[str, object]:
            return {
                "id": name,
                "object": "model",
                "created": now,
                "owned_by": "pagestream",
                "max_model_len": self.engine.max_model_len,
                "type": "model",
                "display_name": name,
                "created_at": stamp,
                **extra,
            }

        data = [entry(name, root=str(self.engine.model_dir)) for name in self.names]
        data += [
            entry(name, root=path, parent=self.names[0])
            for name, path in self.engine.lora_paths.items()
        ]
        return data

    async def models(self, request: web.Request) -> web.Response:
        """OpenAI's list (with Anthropic's page fields `has_more`, `first_id`, `last_id`),
        so either SDK's `models.list()` reads it."""
        data = self.model_entries()
        return json_response(
            {
                "object": "list",
                "data": data,
                "has_more": False,
                "first_id": data[0]["id"],
                "last_id": data[-1]["id"],
            }
        )

    async def model(self, request: web.Request, name: str) -> web.Response:
        """GET /v1/models/{model}: OpenAI's (and Anthropic's) retrieve; 404 in the error
        shape for a name this server does not serve."""
        for entry in self.model_entries():
            if entry["id"] == name:
                return json_response(entry)
        raise BadRequest(f"The model `{name}` does not exist.", "model", status=404)
