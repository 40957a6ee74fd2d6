"""WebSocket frames (`/v1/ws`): `generate`, `cancel`, `ping` and `resume`, a tagged
union decoded with unknown fields forbidden; a failure is a `BadRequest` naming the
field, which the session answers with an `error` frame."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from service.generation_defaults import FIELDS, GenerationDefaults
from service.generation_defaults import NONE as NO_DEFAULTS
from service.protocol import (
    BadRequest,
    ChatMessage,
    NonNegInt,
    Penalty,
    PositiveInt,
    RepetitionPenalty,
    RequestId,
    Temperature,
    TopP,
    Unit,
    decode,
)
from service.protocol_structured import ResponseFormat, StructuredOutputsRequest, structured_spec


class WSParams(Struct, forbid_unknown_fields=True, kw_only=True):
    """Sampling parameters of a WebSocket `generate` frame (SamplingParams' names)."""

    max_tokens: PositiveInt | None = None
    # None: the model's recommendation (generation_config.json), else the API's default
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Unit | None = None
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[NonNegInt] = msgspec.field(default_factory=list)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    n: Annotated[int, Meta(ge=1, le=16)] = 1
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: Annotated[list[NonNegInt], Meta(min_length=1)] | None = None
    bad_words: list[Annotated[str, Meta(max_length=1024)]] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    def structured(self) -> tuple[StructuredOutputsParams, str] | None:
        try:
            spec = structured_spec(self.response_format, self.structured_outputs, {})
        except BadRequest as e:
            raise BadRequest(e.message, f"params.{e.param}" if e.param else None) from e
        return None if spec is None else (spec[0], f"params.{spec[1]}")

    def to_sampling_params(self, defaults: GenerationDefaults = NO_DEFAULTS) -> SamplingParams:
        fields = {f: getattr(self, f) for f in self.__struct_fields__}
        del fields["response_format"]
        for name in FIELDS:
            fields[name] = defaults.pick(name, fields[name])
        fields["max_tokens"] = defaults.cap(fields["max_tokens"])
        spec = self.structured()
        fields["structured_outputs"] = spec[0] if spec else None
        try:
            return SamplingParams(**fields)
        except ValueError as e:
            field, _, why = str(e).partition(": ")
            raise BadRequest(str(e), f"params.{field}" if why else None) from e


class WSGenerate(
    Struct, forbid_unknown_fields=True, tag="generate", tag_field="type", kw_only=True
):
    id: RequestId
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    prompt: str | list[NonNegInt] | None = None
    params: WSParams = msgspec.field(default_factory=WSParams)
    cache_salt: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    # The served model (unchecked when absent) or a LoRA adapter of --lora-modules
    model: Annotated[str, Meta(max_length=256)] | None = None
    # "auto": a conversation too long for the window loses its oldest turns, half a window
    # at a time (service/truncation.py), as chat's and the Responses API's `truncation`
    truncation: Literal["disabled", "auto"] | None = None


class WSCancel(Struct, forbid_unknown_fields=True, tag="cancel", tag_field="type", kw_only=True):
    id: RequestId


class WSPing(Struct, forbid_unknown_fields=True, tag="ping", tag_field="type", kw_only=True):
    pass


class WSResume(Struct, forbid_unknown_fields=True, tag="resume", tag_field="type", kw_only=True):
    """Follow a generation started on another (lost) socket: its frames after `after`
    (a `seq`), then the rest; `resume` is the token its `delta` frames carry."""

    id: RequestId
    resume: Annotated[str, Meta(min_length=1, max_length=64)]
    after: NonNegInt = 0


ClientFrame = WSGenerate | WSCancel | WSPing | WSResume


_ws_decoder = msgspec.json.Decoder(ClientFrame)


def decode_ws(frame: str | bytes) -> WSGenerate | WSCancel | WSPing | WSResume:
    return decode(_ws_decoder, frame)
