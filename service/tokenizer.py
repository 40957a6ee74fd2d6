"""The tokenizer of a Hugging Face checkpoint directory, without transformers.

`tokenizer.json` is run by the `tokenizers` library as is (normalizer, pre-tokenizer,
post-processor, decoder); `tokenizer_config.json` supplies the named special tokens, the
chat template and `add_bos_token`; `generation_config.json` may add end-of-sequence ids.
Chat templates are rendered the way transformers renders them, so prompts match it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.pre_tokenizers import ByteLevel

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


# How much a Unicode normalization form can shrink UTF-8 text, at most: a 4-byte character
# becomes one ASCII byte under NFKC (U+1D400 -> "A"); canonical composition shrinks less
# (3.5x: U+1FBE U+0308 U+0301 -> U+0390).  Checked over every code point and composition.
_UNICODE_NORMALIZATION_SHRINK = 4


def _normalizer_shrink(spec: Mapping[str, Any] | None) -> float | None:
    """At most how many times fewer UTF-8 bytes the normalizer's output can have than its
    input, or None when it can delete text (Strip, BertNormalizer, a Replace by "", ...)."""
    if spec is None:
        return 1.0
    kind = spec.get("type")
    if kind == "Sequence":
        total = 1.0
        for part in spec.get("normalizers", []):
            f = _normalizer_shrink(part)
            if f is None:
                return None
            total *= f
        return total
    if kind == "Prepend":
        return 1.0
    if kind == "Replace":
        pattern, content = spec.get("pattern") or {}, spec.get("content")
        if not isinstance(content, str) or not content or "String" not in pattern:
            return None  # deletes, or a regex whose matches have no length bound
        return max(1.0, len(str(pattern["String"]).encode()) / len(content.encode()))
    if kind in ("NFC", "NFD", "NFKC", "NFKD"):
        return float(_UNICODE_NORMALIZATION_SHRINK)
    return None


def _pre_tokenizer_kind(spec: Mapping[str, Any] | None) -> str | None:
    """'bytes' (a ByteLevel step maps each byte to one character), 'chars', or None when a
    step can drop text (Whitespace, BertPreTokenizer, a split that removes its
    delimiters, ...)."""
    if spec is None:
        return "chars"
    kind = spec.get("type")
    if kind == "Sequence":
        kinds = [_pre_tokenizer_kind(p) for p in spec.get("pretokenizers", [])]
        if None in kinds:
            return None
        return "bytes" if "bytes" in kinds else "chars"
    if kind == "ByteLevel":
        return "bytes"
    if kind in ("Metaspace", "Digits"):
        return "chars"
    if kind in ("Split", "Punctuation") and str(spec.get("behavior", "")).lower() != "removed":
        return "chars"
    return None


def bytes_per_token_bound(spec: Mapping[str, Any]) -> int | None:
    """An M such that any text of b UTF-8 bytes encodes to at least b / M tokens under the
    tokenizer.json `spec`; None when no such bound holds.

    It holds when the pipeline cannot drop text: the normalizer only rewrites (its worst
    shrink factor F), the pre-tokenizer only splits, the BPE model can spell every byte
    (byte-level: the 256-character alphabet is in the vocabulary; otherwise byte fallback
    with all 256 `<0xNN>` tokens), no added token swallows the whitespace beside it
    (lstrip / rstrip) and nothing truncates.  Then every byte of the normalized text is
    covered by one token, and a token covers at most L bytes (its vocabulary string: one
    byte per character for byte-level vocabularies, its UTF-8 length otherwise, or an
    added token's content), so M = ceil(F * L).  WordPiece (long words become one [UNK]),
    Unigram and any step not named above give None."""
    if spec.get("truncation"):
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    kind = _pre_tokenizer_kind(spec.get("pre_tokenizer"))
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    if shrink is None or kind is None or model.get("type") != "BPE" or not isinstance(vocab, dict):
        return None
    if kind == "bytes":
        if not all(ch in vocab for ch in ByteLevel.alphabet()):
            return None
        longest = max(map(len, vocab), default=1)
    else:
        if not model.get("byte_fallback") or not all(f"<0x{b:02X}>" in vocab for b in range(256)):
            return None
        longest = max((len(k.encode()) for k in vocab), default=1)
    added = spec.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    longest = max([longest, *(len(str(a.get("content", "")).encode()) for a in added)])
    return math.ceil(shrink * max(1, longest))


@dataclass(frozen=True)
class Codec:
    """What encoding and decoding need, and nothing else, so it pickles small: a worker
    process (service/tokenize_pool.py) gets one.  The batch calls are the `tokenizers`
    calls that release the GIL while the Rust code runs (`encode` and `decode` hold it
    for their whole run), and `encode_batch_fast` skips the offsets, whose bookkeeping
    costs as much memory as the rest and is freed with the GIL held."""

    backend: _HFTokenizer
    bos_token_id: int | None = None  # prepended with add_special_tokens
    eos_token_id: int | None = None  # appended with add_special_tokens

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        run = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        out = [e.ids for e in run(list(texts), add_special_tokens=add_special_tokens)]
        if add_special_tokens:
            for ids in out:
                if self.bos_token_id is not None:
                    ids.insert(0, self.bos_token_id)
                if self.eos_token_id is not None:
                    ids.append(self.eos_token_id)
        return out

    def encode_pairs(
        self,
        pairs: Sequence[tuple[str, str]],
        second_max: int | None = None,
        max_len: int | None = None,
    ) -> list[list[int]]:
        """Each (first, second) text pair as one input, as transformers' `tokenizer(text,
        text_pair)` builds it for a cross-encoder: the tokenizer.json post-processor's pair
        template, or the special tokens added here around each part.  `second_max`: the
        second part keeps its first so many tokens (Cohere's max_tokens_per_doc);
        `max_len`: the whole input keeps at most so many, cut as transformers'
        `truncation=True` (longest first) cuts, special tokens kept."""
        firsts = self.backend.encode_batch([a for a, _ in pairs], add_special_tokens=False)
        seconds = self.backend.encode_batch([b for _, b in pairs], add_special_tokens=False)
        bos = [] if self.bos_token_id is None else [self.bos_token_id]
        eos = [] if self.eos_token_id is None else [self.eos_token_id]
        specials = (
            2 * (len(bos) + len(eos))
            if bos or eos
            else self.backend.num_special_tokens_to_add(True)
        )
        out = []
        for ea, eb in zip(firsts, seconds, strict=True):
            if second_max is not None:
                eb.truncate(second_max)
            if max_len is not None:
                la, lb = longest_first(len(ea.ids), len(eb.ids), max_len - specials)
                ea.truncate(la)
                eb.truncate(lb)
            if bos or eos:
                out.append(bos + ea.ids + eos + bos + eb.ids + eos)
            else:
                out.append(self.backend.post_process(ea, eb, add_special_tokens=True).ids)
        return out

    def decode_batch(
        self, seqs: Sequence[Sequence[int]], skip_special_tokens: bool = True
    ) -> list[str]:
        return self.backend.decode_batch(
            [list(s) for s in seqs], skip_special_tokens=skip_special_tokens
        )


def longest_first(la: int, lb: int, budget: int) -> tuple[int, int]:
    """The lengths two parts keep within `budget` tokens, as the tokenizers library's
    longest-first truncation (what transformers' `truncation=True` runs for a fast
    tokenizer) leaves them: the shorter part (the first on a tie) keeps up to half the
    budget, rounded down, and the longer takes the rest."""
    budget = max(budget, 0)
    if la + lb <= budget:
        return la, lb
    if la <= lb:
        keep = min(la, budget // 2)
        return keep, min(lb, budget - keep)
    keep = min(lb, budget // 2)
    return min(la, budget - keep), keep


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
        # The BOS a prompt encoded with special tokens starts with (either way), if any.
        self.leading_bos = self.bos_token_id if pp_bos or self._prepend_bos else None
        self._append_eos = add_eos_token and self.eos_token_id is not None and not pp_eos
        self.codec = Codec(
            tokenizer,
            self.bos_token_id if self._prepend_bos else None,
            self.eos_token_id if self._append_eos else None,
        )
        self.templates = ChatTemplates(chat_template, self.special_tokens)

    def use_chat_template(self, source: str | None, content_format: str = "auto") -> None:
        """The server's --chat-template (None: keep the checkpoint's) and
        --chat-template-content-format."""
        if source is not None:
            self.chat_template = source
        self.templates = ChatTemplates(
            self.chat_template, self.special_tokens, self.templates.max_output_chars,
            content_format,
        )  # fmt: skip

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
        tok = cls(
            backend,
            special_tokens=special,
            extra_special_tokens=extra,
            chat_template=template,
            model_max_length=int(max_len) if max_len is not None else None,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            add_eos_token=bool(cfg.get("add_eos_token", False)),
            extra_eos_token_ids=_id_list(gen.get("eos_token_id")),
        )
        tok.max_bytes_per_token  # noqa: B018 - computed here, at load, not on a request
        return tok

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

    @cached_property
    def max_bytes_per_token(self) -> int | None:
        """At most how many UTF-8 bytes of text one token stands for (see
        `bytes_per_token_bound`), or None when this tokenizer can drop text."""
        return bytes_per_token_bound(json.loads(self._tok.to_str()))

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

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """`encode` of each text, with the GIL released while the tokenizer runs (for
        threads; see `Codec`)."""
        return self.codec.encode_batch(texts, add_special_tokens)

    def decode_batch(
        self, seqs: Sequence[Sequence[int]], skip_special_tokens: bool = True
    ) -> list[str]:
        """`decode` of each id list, with the GIL released while the tokenizer runs."""
        return self.codec.decode_batch(seqs, skip_special_tokens)

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
