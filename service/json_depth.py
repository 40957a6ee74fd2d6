"""A nesting-depth limit on client JSON, checked on the raw bytes before anything decodes.

Every decoder and encoder the server hands client data to recurses per level of nesting
(msgspec, `json`, pickle on the way to a template worker, jinja's `tojson`, orjson's 255
levels), and Python's own limit is ~1,000 frames: a body 990 levels deep decoded, then
raised `RecursionError` somewhere later (a 500, or a template worker lost).  Checking the
depth once, at the edge, makes every later step safe: no client value is deeper than
`MAX_JSON_DEPTH`.

The scan is not recursive and costs nothing for ordinary bodies: a text with at most
`MAX_JSON_DEPTH` opening brackets cannot nest deeper, and only bodies with more are
scanned, vectorised (numpy: a few ms for the 4 MiB body limit).
"""

from __future__ import annotations

import numpy as np

# Levels of `[`/`{` nesting a request may hold, the body's own object included.  OpenAI's
# structured outputs allow 10 levels of schema nesting (about 20 JSON levels); this leaves
# room for that inside any field and stays far below every recursion limit downstream.
MAX_JSON_DEPTH = 64

_QUOTE, _COLON = ord('"'), ord(":")
# Per byte: +1 opens a level, -1 closes one; and which bytes the scan looks at at all.
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_STRUCTURAL = _STEP != 0
_STRUCTURAL[[_QUOTE, _COLON]] = True


class TooDeep(ValueError):
    """JSON nested past the limit; `field` is the top-level key it was found under."""

    def __init__(self, depth_limit: int, field: str | None) -> None:
        where = f" (in `{field}`)" if field else ""
        super().__init__(
            f"JSON nested more than {depth_limit} levels deep{where}; at most "
            f"{depth_limit} levels of arrays and objects are allowed"
        )
        self.field = field
        self.limit = depth_limit


def _cheap(text: bytes | str, limit: int) -> bool:
    """True when `text` has too few opening brackets to nest past `limit`."""
    if isinstance(text, str):
        return text.count("[") + text.count("{") <= limit
    return text.count(b"[") + text.count(b"{") <= limit


def check_depth(text: bytes | str, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise TooDeep when the JSON `text` nests arrays and objects more than `limit` levels
    (brackets inside strings do not count).  Text that is not JSON is left to the decoder:
    the answer for it is only meaningful up to where it stops being JSON."""
    if _cheap(text, limit):
        return
    raw = text.encode() if isinstance(text, str) else bytes(text)
    # Escapes cannot change the depth, but `\"` would flip string parity: blank them out
    # with same-length filler (left to right, `\\` pairs first, as a JSON lexer reads them).
    raw = raw.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    a = np.frombuffer(raw, dtype=np.uint8)
    pos = np.flatnonzero(_STRUCTURAL[a])  # quotes, colons and brackets, in order
    c = a[pos]
    # Outside strings: an even number of quotes so far (a uint8 running count keeps parity).
    outside = (np.cumsum(c == _QUOTE, dtype=np.uint8) & 1) == 0
    step = _STEP[c]
    step[~outside] = 0
    depth = np.cumsum(step, dtype=np.int32)
    over = np.flatnonzero(depth > limit)
    if over.size:
        at = int(over[0])
        colons = (c[:at] == _COLON) & outside[:at] & (depth[:at] == 1)
        members = pos[:at][colons]
        raise TooDeep(limit, _key_before(raw, int(members[-1])) if members.size else None)


def _key_before(raw: bytes, colon: int) -> str | None:
    """The object key whose `:` is at `colon`: the name of the top-level member the
    excess depth was found in (None when the body is not an object)."""
    if not raw.lstrip().startswith(b"{"):
        return None
    head = raw[:colon].rstrip()
    start = head.rfind(b'"', 0, len(head) - 1)
    if not head.endswith(b'"') or start < 0:
        return None
    return head[start + 1 : -1].decode(errors="replace")
