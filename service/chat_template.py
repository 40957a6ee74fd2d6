"""Chat templates: rendered as transformers renders them, in a bounded jinja2 sandbox.

A template is code.  The checkpoint's own templates are trusted; a template or template
variable sent by a client is not.  Everything here is picklable plain data, so the server
can render in worker processes (service/render_pool.py) that it can kill on a deadline;
the limits below are the in-process line of defence (they also guard the offline LLM API).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cache
from typing import Any, ClassVar, NamedTuple

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
# Variables the server itself passes: a request may not override them through
# chat_template_kwargs (they would rewrite the conversation, not parametrise it).
RESERVED_VARIABLES = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "tools",
        "documents",
        "chat_template",
        "raise_exception",
        "strftime_now",
        "tokenize",
        *NAMED_SPECIAL_TOKENS,
    }
)
DEFAULT_MAX_OUTPUT_CHARS = 8 << 20
# How message content reaches the template (vLLM's --chat-template-content-format):
# "string" joins a list of text parts into one string; "openai" hands every content over
# as OpenAI's list of parts ({"type": "text", "text": ...}), a string one as one part;
# "auto" picks "openai" for a template that loops over a message's content, else "string".
CONTENT_FORMATS = ("auto", "string", "openai")
_TEMPLATE_CACHE_SIZE = 32
_WIDTH = re.compile(r"%[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_FORMAT_WIDTH = re.compile(r"\{[^{}]*:[^{}]*?(\d+)[^{}]*\}")


class TemplateError(ValueError):
    """A conversation or template the server will not render; `param` names the field."""

    def __init__(self, message: str, param: str | None = "messages") -> None:
        super().__init__(message)
        self.param = param


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body, as in transformers
    (which also records the span for assistant masks; we never need those)."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes; templates expect plain JSON (transformers' filter).
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox (no attribute writes, no list mutation, range() capped at
    100,000) plus size limits on the operations that allocate in one C call: repetition
    (`'x' * n`), powers, %-formatting widths, and int arguments to calls and filters
    (`center(10**9)`, `'{:>999999999}'.format(x)`).  Loops are bounded by the caller's
    deadline, not here: a thread cannot be interrupted, so the server renders in processes."""

    intercepted_binops = frozenset({"*", "**", "%"})

    def __init__(self, max_size: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.max_size = max_size
        for name, fn in list(self.filters.items()):
            self.filters[name] = self._guard_filter(fn)

    def _check_int(self, v: Any) -> None:
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > self.max_size:
            raise SecurityError(f"a number argument of {v} exceeds the template size limit")

    def _guard_filter(self, fn: Any) -> Any:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            for v in (*args, *kwargs.values()):
                self._check_int(v)
            return fn(*args, **kwargs)

        # Keep jinja's pass_context/pass_environment markers.
        guarded.__dict__.update(getattr(fn, "__dict__", {}))
        jinja_pass = getattr(fn, "jinja_pass_arg", None)
        if jinja_pass is not None:
            guarded.jinja_pass_arg = jinja_pass  # type: ignore[attr-defined]
        return guarded

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, k in ((left, right), (right, left)):
                big = isinstance(seq, str | list | tuple) and isinstance(k, int)
                if big and len(seq) * max(k, 0) > self.max_size:
                    raise SecurityError("string or list repetition exceeds the size limit")
        elif operator == "**":
            if isinstance(right, int) and abs(right) > 64 and isinstance(left, int):
                raise SecurityError("integer power exceeds the size limit")
        elif operator == "%" and isinstance(left, str):
            for width, prec in _WIDTH.findall(left):
                for w in (width, prec):
                    if w == "*" or (w and int(w) > self.max_size):
                        raise SecurityError("format width exceeds the size limit")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        for v in (*args, *kwargs.values()):
            __self._check_int(v)
        # The sandbox hands out str.format wrapped; the bound method is underneath.
        method = getattr(__obj, "__wrapped__", __obj)
        fmt = getattr(method, "__self__", None)
        if isinstance(fmt, str) and getattr(method, "__name__", "") in ("format", "format_map"):
            for w in _FORMAT_WIDTH.findall(fmt):
                if int(w) > __self.max_size:
                    raise SecurityError("format width exceeds the size limit")
        return super().call(__context, __obj, *args, **kwargs)


@cache
def sandbox(max_size: int = DEFAULT_MAX_OUTPUT_CHARS) -> BoundedSandbox:
    env = BoundedSandbox(
        max_size,
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = env._guard_filter(_tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _text_parts(content: Any) -> list[str]:
    """A message content's texts: a string is one; of a list of OpenAI parts, each text
    part's; other types are refused."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list | tuple):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
                continue
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise ValueError(f"unsupported message content part (type {kind!r})")
        return texts
    raise ValueError(f"message content must be a string or a list of parts, not {type(content)}")


def _message_content(content: Any, as_parts: bool = False) -> Any:
    """Content as the template reads it: one string (vLLM joins text parts with
    newlines, so the same request renders the same prompt), or with `as_parts` a list of
    text parts."""
    texts = _text_parts(content)
    if as_parts:
        return [{"type": "text", "text": t} for t in texts]
    return texts[0] if isinstance(content, str) else "\n".join(texts)


def loops_over_content(template: jinja2.nodes.Template) -> bool:
    """Whether a parsed template iterates over a message's `content` (`for part in
    message['content']` or `message.content`): such a template expects OpenAI's list of
    parts, and "auto" hands it that."""
    for loop in template.find_all(jinja2.nodes.For):
        it = loop.iter
        if isinstance(it, jinja2.nodes.Filter):  # `content | selectattr(...)` and the like
            it = it.node
        if isinstance(it, jinja2.nodes.Getattr) and it.attr == "content":
            return True
        if (
            isinstance(it, jinja2.nodes.Getitem)
            and isinstance(it.arg, jinja2.nodes.Const)
            and it.arg.value == "content"
        ):
            return True
    return False


def load_chat_template(arg: str) -> str:
    """--chat-template as vLLM reads it: a file's text, or the template itself when the
    argument is not a file but holds Jinja syntax.  Anything else is an error naming it."""
    from pathlib import Path

    path = Path(arg)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {arg}: cannot read it: {e}") from None
    if "{{" in arg or "{%" in arg:
        return arg
    raise ValueError(f"--chat-template {arg!r}: no such file, and not a Jinja template")


def _open_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """`text` cut just after the last place the final message's content appears (as
    transformers' continue_final_message: its trailing whitespace kept only where the
    template kept it)."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, list):  # as OpenAI's parts (content format "openai")
        content = _message_content(content)
    stripped = content.strip() if isinstance(content, str) else ""
    if not stripped:
        raise TemplateError(
            "continue_final_message needs a final message with text to continue", "messages"
        )
    at = text.rfind(stripped)
    if at < 0:
        raise TemplateError(
            "continue_final_message: the final message's content does not appear in the "
            "rendered chat template, so there is no place to continue it from",
            "messages",
        )
    whole = text[at : at + len(content)] == content
    return text[: at + (len(content) if whole else len(stripped))]


def normalize_messages(
    messages: Sequence[Mapping[str, Any]], as_parts: bool = False
) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise ValueError(f"a chat message must be an object, not {type(m).__name__}")
        # Like transformers: a key set to None (OpenAI's content=None) counts as absent.
        msg = {k: v for k, v in m.items() if v is not None}
        if "content" in msg:
            msg["content"] = _message_content(msg["content"], as_parts)
        out.append(msg)
    return out


class _Compiled(NamedTuple):
    template: jinja2.Template
    names: frozenset[str]  # the variables it reads
    loops_over_content: bool


class ChatTemplates:
    """A checkpoint's chat template(s) and special tokens, with a bounded compile cache."""

    def __init__(
        self,
        source: str | dict[str, str] | None,
        special_tokens: Mapping[str, str] | None = None,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
        content_format: str = "auto",
    ) -> None:
        if content_format not in CONTENT_FORMATS:
            raise ValueError(f"content format must be one of {CONTENT_FORMATS}")
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.max_output_chars = max_output_chars
        self.content_format = content_format
        self._compiled: OrderedDict[str, _Compiled] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_compiled": OrderedDict()}

    def select(self, name: str | None) -> str:
        """The template source: `name` is a template name when the tokenizer has several,
        else a literal template; None is the checkpoint's default."""
        source = self.source
        if name is not None:
            source = source[name] if isinstance(source, dict) and name in source else name
        elif isinstance(source, dict):
            if "default" not in source:
                raise ValueError(
                    f"the tokenizer has several chat templates ({', '.join(sorted(source))}) "
                    "and none is named 'default'"
                )
            source = source["default"]
        if source is None:
            raise ValueError(
                "this model's tokenizer has no chat template; use the completions API or a "
                "model with a chat template"
            )
        return source

    def compile(self, source: str) -> _Compiled:
        """The compiled template, the variables it reads and whether it loops over a
        message's content (LRU-cached: clients that may send templates must not grow this
        without bound)."""
        hit = self._compiled.get(source)
        if hit is not None:
            self._compiled.move_to_end(source)
            return hit
        env = sandbox(self.max_output_chars)
        try:
            tree = env.parse(source)
            names = frozenset(jinja2.meta.find_undeclared_variables(tree))
            entry = _Compiled(env.from_string(source), names, loops_over_content(tree))
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template does not compile: {e}") from e
        self._compiled[source] = entry
        if len(self._compiled) > _TEMPLATE_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return entry

    def request_kwargs(self, source: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """A client's chat_template_kwargs, cut down to variables the template reads
        (others are dropped, as vLLM drops them); reserved names are refused."""
        names = self.compile(source).names
        for k in kwargs:
            if k in RESERVED_VARIABLES:
                raise TemplateError(
                    f"chat_template_kwargs may not set {k!r}", f"chat_template_kwargs.{k}"
                )
        return {k: v for k, v in kwargs.items() if k in names}

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text, as transformers' apply_chat_template renders it (`tokenize=
        False`).  Extra kwargs become template variables.  Raises ValueError when there is
        no template, the template rejects the conversation, or it breaks a sandbox limit.
        continue_final_message: the text ends with the final message's content, whatever
        the template writes after it (its end of turn), so the model carries that message
        on."""
        compiled = self.compile(self.select(chat_template))
        variables = {**self.special_tokens, **kwargs}
        cap = self.max_output_chars
        param = "chat_template" if chat_template else "messages"
        fmt = self.content_format
        as_parts = fmt == "openai" or (fmt == "auto" and compiled.loops_over_content)
        normalized = normalize_messages(messages, as_parts)
        try:
            parts, size = [], 0
            for piece in compiled.template.generate(
                messages=normalized,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            ):
                size += len(piece)
                if size > cap:
                    raise TemplateError(
                        f"the rendered chat template exceeds {cap} characters", param
                    )
                parts.append(piece)
            text = "".join(parts)
        except SecurityError as e:
            raise TemplateError(f"chat template refused by the sandbox: {e}", param) from e
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template: {e.message or e}") from e
        except (TypeError, OverflowError) as e:  # e.g. a non-string role added to a string
            raise ValueError(f"chat template: {e}") from e
        return _open_final_message(text, normalized) if continue_final_message else text
