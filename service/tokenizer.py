"""The tokenizer of a Hugging Face checkpoint directory, without transformers.

`tokenizer.json` is run by the `tokenizers` library as is (normalizer, pre-tokenizer,
post-processor, decoder); `tokenizer_config.json` supplies the named special tokens, the
chat template and `add_bos_token`; `generation_config.json` may add end-of-sequence ids.
Chat templates are rendered the way transformers renders them, so prompts match it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cache, cached_property
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
# transformers' "no limit" model_max_length is 1e30; anything this large means none.
_NO_LIMIT = 10**12


def _token_content(value: Any) -> str | None:
    """A special token as a string: configs hold plain strings or AddedToken dicts."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"unrecognised special token entry {value!r}")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


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


@cache
def _jinja_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _message_content(content: Any) -> Any:
    """OpenAI content parts -> one string; strings pass through; other types are refused."""
    if isinstance(content, str):
        return content
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
        # vLLM joins text parts with newlines, so the same request renders the same prompt.
        return "\n".join(texts)
    raise ValueError(f"message content must be a string or a list of parts, not {type(content)}")


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise ValueError(f"a chat message must be an object, not {type(m).__name__}")
        # Like transformers: a key set to None (OpenAI's content=None) counts as absent.
        msg = {k: v for k, v in m.items() if v is not None}
        if "content" in msg:
            msg["content"] = _message_content(msg["content"])
        out.append(msg)
    return out


class Tokenizer:
    """Encode/decode and chat-template rendering for one checkpoint's tokenizer."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        extra_special_tokens: Sequence[str] = (),
        chat_template: str | dict[str, str] | None = None,
        model_max_length: int | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self.special_tokens: dict[str, str] = {
            k: v for k, v in (special_tokens or {}).items() if v is not None
        }
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"))
        self.eos_token_id = self._id_of(self.special_tokens.get("eos_token"))
        self.pad_token_id = self._id_of(self.special_tokens.get("pad_token"))
        eos = [self.eos_token_id] if self.eos_token_id is not None else []
        self._eos_ids = tuple(dict.fromkeys(eos + [int(i) for i in extra_eos_token_ids]))
        self._extra_special_ids = [
            i for i in (self._id_of(t) for t in extra_special_tokens) if i is not None
        ]
        # add_bos_token asks for a bos at the start; tokenizer.json's post-processor may
        # already put one there (Llama-style), and then we must not add a second.
        plain = tokenizer.encode("a", add_special_tokens=False).ids
        full = tokenizer.encode("a", add_special_tokens=True).ids
        pp_bos = len(full) > len(plain) and full[:1] == [self.bos_token_id]
        pp_eos = len(full) > len(plain) and full[-1:] == [self.eos_token_id]
        self._prepend_bos = add_bos_token and self.bos_token_id is not None and not pp_bos
        self._append_eos = add_eos_token and self.eos_token_id is not None and not pp_eos
        self._templates: dict[str, jinja2.Template] = {}

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` (+ `tokenizer_config.json`, `generation_config.json`,
        `special_tokens_map.json`, `chat_template.jinja` when present) from a directory."""
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"{root}: no tokenizer.json (only fast tokenizers are supported)")
        try:
            backend = _HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"{tok_file}: cannot load: {e}") from e
        cfg = _read_json(root / "tokenizer_config.json")
        legacy = _read_json(root / "special_tokens_map.json")
        gen = _read_json(root / "generation_config.json")

        special = {
            k: _token_content(cfg.get(k) if cfg.get(k) is not None else legacy.get(k))
            for k in NAMED_SPECIAL_TOKENS
        }
        extra: list[str] = []
        for key in ("additional_special_tokens", "extra_special_tokens"):
            for src in (cfg, legacy):
                val = src.get(key)
                if isinstance(val, dict):  # transformers 5's named extra tokens
                    val = list(val.values())
                if isinstance(val, list):
                    extra += [t for t in map(_token_content, val) if t is not None]

        # A standalone template file wins over the config entry, as in transformers.
        template: Any = cfg.get("chat_template")
        if (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        elif template is None and (root / "chat_template.json").is_file():
            template = _read_json(root / "chat_template.json").get("chat_template")
        if isinstance(template, list):
            template = {t["name"]: t["template"] for t in template}

        max_len = cfg.get("model_max_length")
        if not isinstance(max_len, int | float) or max_len >= _NO_LIMIT:
            max_len = None
        return cls(
            backend,
            special_tokens=special,
            extra_special_tokens=extra,
            chat_template=template,
            model_max_length=int(max_len) if max_len is not None else None,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            add_eos_token=bool(cfg.get("add_eos_token", False)),
            extra_eos_token_ids=_id_list(gen.get("eos_token_id")),
        )

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (for incremental decoding)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: the tokenizer's eos, then generation_config's."""
        return self._eos_ids

    @cached_property
    def all_special_ids(self) -> list[int]:
        """Ids of every special token (named, additional, and tokenizer.json's special)."""
        ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        for tok in self.special_tokens.values():
            if (i := self._id_of(tok)) is not None:
                ids.add(i)
        ids.update(self._extra_special_ids)
        return sorted(ids)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`.  Prompts rendered by a chat template carry their own special
        tokens and should be encoded with `add_special_tokens=False`."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            if self._prepend_bos:
                ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
            if self._append_eos:
                ids.append(self.eos_token_id)  # type: ignore[arg-type]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _template(self, name: str | None) -> jinja2.Template:
        # `name` is a template name when the tokenizer has several, else a literal template.
        source = self.chat_template
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
        if source not in self._templates:
            try:
                self._templates[source] = _jinja_env().from_string(source)
            except jinja2.TemplateSyntaxError as e:
                raise ValueError(f"the chat template does not compile: {e}") from e
        return self._templates[source]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for a conversation, as transformers' apply_chat_template renders it
        (`tokenize=False`).  Extra kwargs become template variables.  Raises ValueError when
        there is no template or the template rejects the conversation."""
        template = self._template(chat_template)
        variables = {**self.special_tokens, **kwargs}
        try:
            return template.render(
                messages=_normalize_messages(messages),
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template: {e.message or e}") from e
        except TypeError as e:  # e.g. a non-string role concatenated to a string
            raise ValueError(f"chat template: {e}") from e
