"""The tokenizer of a Hugging Face checkpoint directory, without transformers.

`tokenizer.json` is run by the `tokenizers` library as is (normalizer, pre-tokenizer,
post-processor, decoder); `tokenizer_config.json` supplies the named special tokens, the
chat template and `add_bos_token`; `generation_config.json` may add end-of-sequence ids.
Chat templates are rendered the way transformers renders them, so prompts match it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from service.chat_template import NAMED_SPECIAL_TOKENS, ChatTemplates

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
        self.templates = ChatTemplates(chat_template, self.special_tokens)

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
        return self.templates.render(
            messages,
            add_generation_prompt,
            chat_template=chat_template,
            tools=tools,
            documents=documents,
            **kwargs,
        )
