"""Per-request limits the service enforces before the engine sees a request.

Each has a `serve` flag (docs/FLAGS.md; what each answers: docs/LIMITS.md).  The decoders
(service/protocol.py and the per-edge service/protocol_openai.py, service/protocol_ws.py)
check types and fixed ranges; these are the bounds an operator may want to move.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.sampling_params import SamplingParams
from service.protocol import BadRequest


@dataclass
class Limits:
    max_stop_strings: int = 32
    max_stop_string_chars: int = 1024
    max_prompts_per_request: int = 256  # prompts in /v1/completions, inputs in /v1/embeddings
    max_choices_per_request: int = 256  # n × prompts: sequences one request may start
    max_logprobs: int = 20  # logprobs / top_logprobs (the sampler's ceiling is 20)
    # Prompt-logprob entries one response may carry: prompt tokens x (top + 1), repeated in
    # each of a prompt's n choices on /v1/completions (echo with logprobs, prompt_logprobs).
    max_prompt_logprob_entries: int = 1_000_000
    max_ws_frame_bytes: int = 1 << 20
    max_ws_generations: int = 64  # generations in flight on one WebSocket
    max_websockets: int = 1024  # open WebSockets per server
    trust_request_chat_template: bool = False
    template_workers: int = 2  # chat-template render processes
    template_timeout: float = 3.0  # seconds one chat-template render may take
    template_memory_bytes: int = 1 << 30  # address space a render process may add
    max_template_output_chars: int = 8 << 20
    # Tokenization (service/tokenize_pool.py): seconds one (de)tokenization may take,
    # waiting included; threads and worker processes; bigger inputs than
    # tokenize_process_bytes (UTF-8 bytes; 4 a token id) go to a killable process.
    tokenize_timeout: float = 2.0
    tokenize_workers: int = 2
    tokenize_process_bytes: int = 256 << 10

    def check_sampling(self, p: SamplingParams, *, prefix: str = "", logprobs_field: str = "logprobs",
                       prompts: int = 1) -> None:  # fmt: skip
        """Stop strings, logprobs and fan-out; BadRequest naming the field."""
        if len(p.stop) > self.max_stop_strings:
            raise BadRequest(
                f"{len(p.stop)} stop strings; at most {self.max_stop_strings} are allowed",
                f"{prefix}stop",
            )
        for i, s in enumerate(p.stop):
            if len(s) > self.max_stop_string_chars:
                raise BadRequest(
                    f"stop string {i} has {len(s)} characters; at most "
                    f"{self.max_stop_string_chars} are allowed",
                    f"{prefix}stop",
                )
        if p.logprobs is not None and p.logprobs > self.max_logprobs:
            raise BadRequest(
                f"{logprobs_field} is {p.logprobs}; at most {self.max_logprobs} is allowed",
                f"{prefix}{logprobs_field}",
            )
        if p.n * prompts > self.max_choices_per_request:
            what = f"n ({p.n}) × prompts ({prompts})" if prompts > 1 else f"n ({p.n})"
            raise BadRequest(
                f"{what} is {p.n * prompts} sequences; at most "
                f"{self.max_choices_per_request} per request",
                f"{prefix}n",
            )

    def check_prompt_logprobs(self, parts: dict[str, int]) -> None:
        """parts: request field -> the prompt-logprob entries the response would carry
        because of it.  Past the limit, a 400 naming the field that asks for the most
        (the response would be built, and held, whole)."""
        total, limit = sum(parts.values()), self.max_prompt_logprob_entries
        if total > limit:
            field = max(parts, key=parts.__getitem__)
            raise BadRequest(
                f"the response would carry {total:,} prompt logprobs (prompt tokens x "
                f"choices x ({field} + 1)); at most {limit:,} per request",
                field,
            )

    def check_prompt_count(self, count: int, field: str = "prompt") -> None:
        if count > self.max_prompts_per_request:
            raise BadRequest(
                f"{count} prompts in one request; at most {self.max_prompts_per_request}",
                field,
                status=413,
            )
