"""Structured-output request fields: OpenAI's `response_format`, vLLM's
`structured_outputs` and the older `guided_*` names, reduced to one
`StructuredOutputsParams` (or a 400 naming the field)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from scheduler.sampling_params import StructuredOutputsParams
from service.json_depth import TooDeep, check_depth
from service.protocol import BadRequest


class JsonSchemaFormat(Struct, forbid_unknown_fields=True, kw_only=True):
    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(Struct, forbid_unknown_fields=True, kw_only=True):
    # "json" and "regex", and `value` on them and on "json_object", are TGI's forms, which
    # huggingface_hub's InferenceClient sends (it turns OpenAI's json_schema into
    # {"type": "json_object", "value": schema}).
    type: Literal["text", "json_object", "json_schema", "structural_tag", "json", "regex"]
    json_schema: JsonSchemaFormat | None = None
    value: dict[str, Any] | str | None = None


class StructuredOutputsRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's `structured_outputs` request field."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: Annotated[list[str], Meta(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's knobs we do not implement (refused when set).
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


def _schema_text(schema: dict[str, Any] | str, field: str) -> str:
    """A JSON schema as compact JSON text (also the grammar cache's key), checked to be an
    object.  Key order is kept, never sorted: the grammar writes properties in the order
    the schema lists them (reasoning before answer is the point of such a schema), as
    OpenAI's strict mode and vLLM do; two schemas that differ only in order are two
    grammars."""
    if isinstance(schema, str):
        try:
            check_depth(schema)  # a schema sent as text: the body's nesting limit holds
            schema = json.loads(schema)
        except TooDeep as e:
            raise BadRequest(
                f"{field} is JSON nested more than {e.limit} levels deep", field
            ) from None
        except ValueError as e:
            raise BadRequest(f"{field} is not valid JSON: {e}", field) from e
    if not isinstance(schema, dict):
        raise BadRequest(f"{field} must be a JSON schema object", field)
    return json.dumps(schema, separators=(",", ":"))


Spec = tuple[StructuredOutputsParams, str]  # the constraint, and the field that asked

_UNSUPPORTED_KNOBS = (
    "disable_fallback",
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
    "structural_tag",
)


def _spec(field: str, **kw: Any) -> Spec:
    try:
        return StructuredOutputsParams(**kw), field
    except ValueError as e:
        raise BadRequest(str(e).partition(": ")[2] or str(e), field) from e


def _from_response_format(fmt: ResponseFormat | None) -> list[Spec]:
    if fmt is None:
        return []
    if fmt.value is not None or fmt.type in ("json", "regex"):
        return [_from_tgi_format(fmt)]
    if fmt.type == "text":
        return []
    if fmt.type == "json_object":
        return [_spec("response_format", json_object=True)]
    if fmt.type == "structural_tag":
        raise BadRequest("response_format structural_tag is not supported", "response_format")
    field = "response_format.json_schema.schema"
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise BadRequest("response_format json_schema needs json_schema.schema", field)
    schema = _schema_text(fmt.json_schema.schema, field)
    return [_spec(field, json=schema, strict=bool(fmt.json_schema.strict))]


def _from_tgi_format(fmt: ResponseFormat) -> Spec:
    """TGI's response_format: {"type": "json" | "json_object", "value": a JSON schema} or
    {"type": "regex", "value": a pattern}."""
    field = "response_format.value"
    if fmt.value is None:
        raise BadRequest(f"response_format type {fmt.type!r} needs a value", field)
    if fmt.type == "regex":
        if not isinstance(fmt.value, str):
            raise BadRequest("a regex response_format's value must be a pattern", field)
        return _spec(field, regex=fmt.value)
    if fmt.type not in ("json", "json_object"):
        raise BadRequest(f"response_format type {fmt.type!r} takes no value", field)
    return _spec(field, json=_schema_text(fmt.value, field))


def _from_structured_outputs(so: StructuredOutputsRequest | None) -> list[Spec]:
    if so is None:
        return []
    for name in _UNSUPPORTED_KNOBS:
        if getattr(so, name) is not None:
            raise BadRequest(
                f"structured_outputs.{name} is not supported", f"structured_outputs.{name}"
            )
    kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(so, k) is not None]
    kinds += ["json_object"] if so.json_object else []
    if len(kinds) != 1:
        raise BadRequest(
            "structured_outputs needs exactly one of json, regex, choice, grammar, json_object",
            "structured_outputs",
        )
    k = kinds[0]
    field = f"structured_outputs.{k}"
    if k == "json":
        return [_spec(field, json=_schema_text(so.json, field))]  # type: ignore[arg-type]
    if k == "choice":
        return [_spec(field, choice=tuple(so.choice or ()))]
    if k == "json_object":
        return [_spec(field, json_object=True)]
    return [_spec(field, **{k: getattr(so, k)})]


def _from_guided(guided: dict[str, Any]) -> list[Spec]:
    found = []
    for name, value in guided.items():
        if value is None:
            continue
        if name == "guided_json":
            found.append(_spec(name, json=_schema_text(value, name)))
        elif name == "guided_choice":
            found.append(_spec(name, choice=tuple(value)))
        else:
            found.append(_spec(name, **{name.removeprefix("guided_"): value}))
    return found


def structured_spec(
    fmt: ResponseFormat | None,
    so: StructuredOutputsRequest | None,
    guided: dict[str, Any],
) -> Spec | None:
    """The one constraint a request asks for, and the field that asked (for errors)."""
    found = [*_from_response_format(fmt), *_from_structured_outputs(so), *_from_guided(guided)]
    if len(found) > 1:
        names = ", ".join(f for _, f in found)
        raise BadRequest(f"ask for one structured output at a time (got {names})", found[1][1])
    return found[0] if found else None
