"""Tool calls on chat completions: what the template sees, what decoding is held to, and
how the model's text becomes OpenAI `tool_calls`.

- `tool_choice` "required" or a named function constrains decoding (a JSON schema built
  from the tools' parameters), so the call is valid by construction: a named function's
  output is its arguments object; "required" writes a JSON array of {name, parameters}
  (vLLM's shape for it).
- "auto" leaves decoding free and parses the text with the model family's parser
  (`--tool-call-parser`): Hermes-style `<tool_call>{json}</tool_call>` blocks, or Llama-3
  JSON (`{"name": ..., "parameters": ...}`, `;`-separated, after an optional
  `<|python_tag|>`).  Text that does not parse stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from scheduler.sampling_params import StructuredOutputsParams
from service.protocol import BadRequest, NamedToolChoice, Tool
from service.protocol_openai import ChatCompletionRequest

Mode = Literal["named", "required", "auto"]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _params_schema(tool: Any) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_mode(req: ChatCompletionRequest, parser: str | None) -> Mode | None:
    """How this request uses its tools (None: it does not, or tool_choice is "none")."""
    if not req.tools or req.tool_choice == "none":
        return None
    if isinstance(req.tool_choice, NamedToolChoice):
        return "named"
    if req.tool_choice == "required":
        return "required"
    if parser is None:
        raise BadRequest(
            'tool_choice "auto" needs a tool-call parser: start the server with '
            "--tool-call-parser (hermes or llama3_json), or use tool_choice "
            '"required" or a named function',
            "tool_choice",
        )
    return "auto"


def constraint(
    req: ChatCompletionRequest, mode: Mode | None
) -> tuple[StructuredOutputsParams, str] | None:
    """The structured-output spec a tool_choice imposes, and the field to blame."""
    if mode == "named":
        assert isinstance(req.tool_choice, NamedToolChoice) and req.tools
        name = req.tool_choice.function.name
        i, tool = next((i, t) for i, t in enumerate(req.tools) if t.function.name == name)
        schema = _params_schema(tool)
        field = f"tools[{i}].function.parameters"
    elif mode == "required":
        assert req.tools
        params, defs = _hoist_defs([_params_schema(t) for t in req.tools])
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "parameters": p},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t, p in zip(req.tools, params, strict=True)
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        field = "tools"
    else:
        return None
    # Key order kept: arguments come out in the order the tool's schema lists them.
    text = json.dumps(schema, separators=(",", ":"))
    return StructuredOutputsParams(json=text, strict=True), field


_DEFS_KEYS = ("$defs", "definitions")


def _hoist_defs(schemas: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each tool's parameters, moved under the array schema "required" builds, with the
    root-relative pointers in them still pointing where they did.

    A `$ref` such as "#/$defs/Item" (pydantic's nested models) resolves against the
    document root, which is now the array: each tool's `$defs` / `definitions` move to the
    root's `$defs` (a name another tool already took gets a suffix, so two tools' different
    "Item"s stay apart), and every other root-relative pointer ("#", "#/properties/x") is
    prefixed with the path the tool's parameters now sit at."""
    defs: dict[str, Any] = {}
    out = []
    for i, schema in enumerate(schemas):
        renames: dict[tuple[str, str], str] = {}
        own = {k: schema[k] for k in _DEFS_KEYS if isinstance(schema.get(k), dict)}
        for key, table in own.items():
            for name in table:
                new, n = name, 1
                while new in defs or new in renames.values():
                    new, n = f"{name}_{n}", n + 1
                renames[key, name] = new
        here = f"/items/anyOf/{i}/properties/parameters"

        def fix(ref: str, renames: dict[tuple[str, str], str] = renames, here: str = here) -> str:
            if not ref.startswith("#"):
                return ref  # not a pointer into this document
            parts = ref[1:].split("/")
            if len(parts) >= 3 and parts[0] == "" and (parts[1], _unescape(parts[2])) in renames:
                new = renames[parts[1], _unescape(parts[2])]
                return "#/$defs/" + "/".join([_escape(new), *parts[3:]])
            return "#" + here + ref[1:]

        body = _rewrite_refs({k: v for k, v in schema.items() if k not in own}, fix)
        for key, table in own.items():
            for name, sub in table.items():
                defs[renames[key, name]] = _rewrite_refs(sub, fix)
        out.append(body)
    return out, defs


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _unescape(segment: str) -> str:
    return segment.replace("~1", "/").replace("~0", "~")


def _rewrite_refs(node: Any, fix: Any) -> Any:
    if isinstance(node, dict):
        return {
            k: fix(v) if k == "$ref" and isinstance(v, str) else _rewrite_refs(v, fix)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_rewrite_refs(v, fix) for v in node]
    return node


def template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as HF chat templates expect them (`tools=`)."""
    return tools_for_template(req.tools)


def tools_for_template(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for t in tools:
        fn: dict[str, Any] = {"name": t.function.name, "parameters": _params_schema(t)}
        if t.function.description is not None:
            fn["description"] = t.function.description
        out.append({"type": "function", "function": fn})
    return out


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


# --------------------------------------------------------------------------- parsers
class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them."""

    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        if self.start not in text:
            return text, []
        calls = []
        for body in self._block.findall(text):
            try:
                obj = json.loads(body)
                calls.append(_call(obj["name"], obj.get("arguments", {})))
            except (ValueError, KeyError, TypeError, RecursionError):
                return text, []  # not a well-formed call: leave it as content
        # The text before the first call, as streamed (vLLM's hermes parser keeps it whole
        # too): a stream cannot take back whitespace it already sent.
        return text[: text.index(self.start)] or None, calls


class Llama3JsonParser:
    """Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}`, `; `-separated."""

    start = "<|python_tag|>"
    _decoder = json.JSONDecoder()

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        body = text.strip().removeprefix(self.start).lstrip()
        if not body.startswith("{"):
            return text, []
        calls, pos = [], 0
        try:
            while pos < len(body):
                obj, end = self._decoder.raw_decode(body, pos)
                args = obj.get("parameters", obj.get("arguments", {}))
                calls.append(_call(obj["name"], args))
                pos = end
                rest = body[pos:].lstrip()
                if not rest:
                    break
                if not rest.startswith(";"):
                    return text, []
                pos = len(body) - len(rest) + 1
                while pos < len(body) and body[pos].isspace():
                    pos += 1
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return text, []
        return None, calls


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def make_parser(name: str) -> HermesParser | Llama3JsonParser:
    return PARSERS[name]()


# --------------------------------------------------------------------------- results
def parse_output(
    mode: Mode,
    text: str,
    parser: HermesParser | Llama3JsonParser | None,
    req: ChatCompletionRequest,
) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of one finished choice."""
    if mode == "named":
        assert isinstance(req.tool_choice, NamedToolChoice)
        return None, [_call(req.tool_choice.function.name, text)]
    if mode == "required":
        return None, _required_calls(text)
    assert parser is not None
    return parser.parse(text)


_PARTIAL_CALL = re.compile(
    r'\s*,?\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*'
)


def _required_calls(text: str) -> list[dict[str, Any]]:
    """The calls of a "required" choice's JSON array.  One cut short by max_tokens keeps
    what OpenAI keeps of a truncated call (finish_reason stays "length"): every call whose
    name was written, the last one's arguments as far as they got (not valid JSON); the
    array itself never becomes content."""
    try:
        return [_call(c["name"], c["parameters"]) for c in json.loads(text)]
    except (ValueError, KeyError, TypeError, RecursionError):
        pass
    decoder = json.JSONDecoder()
    calls: list[dict[str, Any]] = []
    body = text.lstrip()
    if not body.startswith("["):
        return calls
    pos = 1
    while True:
        while pos < len(body) and body[pos] in " \t\n\r,":
            pos += 1
        try:
            item, end = decoder.raw_decode(body, pos)
            calls.append(_call(item["name"], item["parameters"]))
            pos = end
        except (ValueError, KeyError, TypeError, RecursionError):
            break
    m = _PARTIAL_CALL.match(body, pos)
    if m is not None:
        calls.append(_call(json.loads(m.group(1)), body[m.end() :]))
    return calls


class ToolStream:
    """One choice's streaming deltas: content as it comes, tool calls as OpenAI deltas."""

    def __init__(self, mode: Mode, parser: Any, req: ChatCompletionRequest) -> None:
        self.mode, self.parser, self.req = mode, parser, req
        self.text = ""  # everything generated
        self.sent = 0  # chars of text already sent as content (auto)
        self.held = False  # auto: a call started; the rest waits for the end
        self.call_id = new_call_id()
        self.named_started = False

    def feed(self, delta: str) -> dict[str, Any]:
        self.text += delta
        if self.mode == "named":
            if not delta and self.named_started:
                return {}
            assert isinstance(self.req.tool_choice, NamedToolChoice)
            call: dict[str, Any] = {"index": 0, "function": {"arguments": delta}}
            if not self.named_started:
                self.named_started = True
                call.update(id=self.call_id, type="function")
                call["function"]["name"] = self.req.tool_choice.function.name
            return {"tool_calls": [call]}
        if self.mode == "required" or self.held:
            return {}
        start = self.parser.start
        i = self.text.find(start, self.sent)
        if i >= 0 or (
            isinstance(self.parser, Llama3JsonParser) and self.text.lstrip().startswith("{")
        ):
            self.held = True
            end = i if i >= 0 else self.sent
            out, self.sent = self.text[self.sent : end], end
            return {"content": out} if out else {}
        # Hold back a tail that could be the start of the marker.
        safe = len(self.text)
        for k in range(min(len(start) - 1, len(self.text)), 0, -1):
            if start.startswith(self.text[-k:]):
                safe = len(self.text) - k
                break
        if isinstance(self.parser, Llama3JsonParser) and not self.text.strip():
            safe = self.sent  # nothing but whitespace yet: a JSON call may follow
        out, self.sent = self.text[self.sent : safe], max(self.sent, safe)
        return {"content": out} if out else {}

    def take(self, delta: str, last: bool) -> tuple[dict[str, Any], bool]:
        """`feed`, merged with `finish` when `delta` is the choice's last: (the delta,
        whether the choice made tool calls)."""
        out = self.feed(delta)
        if not last:
            return out, False
        rest, called = self.finish()
        return merge_delta(out, rest), called

    def finish(self) -> tuple[dict[str, Any], bool]:
        """The last delta, and whether the choice made tool calls."""
        if self.mode == "named":
            return {}, True
        if self.mode == "auto" and not self.held:
            rest = self.text[self.sent :]
            return ({"content": rest} if rest else {}), False
        content, calls = parse_output(self.mode, self.text[self.sent :], self.parser, self.req)
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
        return delta, bool(calls)


def merge_delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    if "content" in b:
        out["content"] = out.get("content", "") + b["content"]
    if "tool_calls" in b:
        out["tool_calls"] = out.get("tool_calls", []) + b["tool_calls"]
    return out
