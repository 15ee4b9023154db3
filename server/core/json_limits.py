"""The limits on how deeply user JSON may nest, and a strict standard-library reader.

Every later step re-serializes or walks user JSON: orjson's encoder stops at 255 levels, and the
gateway wraps a user's schema a few levels deeper (tools, DJL merges). A body nested deeper than
MAX_JSON_DEPTH is refused before any of that runs, with a message naming the limit.

A JSON schema for constrained decoding has a tighter limit, vLLM 0.32's own
(`MAX_STRUCTURED_OUTPUT_JSON_NESTING`, 64): grammar conversion cost grows steeply with nesting
(xgrammar on the demo model: 0.07 s at 64 object levels, 0.5 s at 127, a grammar growing
quadratically). vLLM checks it for `json` constraints only; the gateway checks every schema
(tool parameters, which it compiles itself, included) so every protocol answers the same.

Standard library only, like the rest of the core.
"""

from __future__ import annotations

import json
import re
from typing import Any

from server.core.errors import InvalidRequest

MAX_JSON_DEPTH = 128  # half of orjson's encoder limit (255)
MAX_SCHEMA_DEPTH = 64  # vLLM 0.32's MAX_STRUCTURED_OUTPUT_JSON_NESTING
INT_RANGE = (-(2**63), 2**64 - 1)  # what orjson reads as an integer and writes back
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPENERS = frozenset(b"[{")


def check_depth(text: bytes | str) -> None:
    """Refuse JSON `text` nested deeper than MAX_JSON_DEPTH (arrays and objects)."""
    if nests_deeper(text, MAX_JSON_DEPTH):
        raise InvalidRequest(
            f"The JSON is nested too deeply: objects and arrays may nest at most "
            f"{MAX_JSON_DEPTH} levels"
        )


def check_schema_depth(schema_text: str) -> None:
    """Refuse a JSON schema nested deeper than MAX_SCHEMA_DEPTH (vLLM's own wording)."""
    if nests_deeper(schema_text, MAX_SCHEMA_DEPTH):
        raise InvalidRequest(
            "The JSON schema is nested too deeply: objects and arrays may nest at most "
            f"{MAX_SCHEMA_DEPTH} levels"
        )


def nests_deeper(text: bytes | str, limit: int) -> bool:
    """Whether JSON `text` nests arrays and objects more than `limit` levels (a top-level
    object is one level). Exact for valid JSON; brackets inside strings are not counted."""
    data = text.encode(errors="surrogatepass") if isinstance(text, str) else text
    if data.count(b"[") + data.count(b"{") <= limit:
        return False  # the common case: too few brackets to nest that deep, no scan
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    depth = 0
    for byte in brackets:
        depth += 1 if byte in _OPENERS else -1
        if depth > limit:
            return True
    return False


def strict_loads(text: str) -> Any:
    """`json.loads` held to what the gateway's encoder can write back: no NaN/Infinity, no
    integer beyond 64 bits, no lone surrogate, no nesting beyond MAX_JSON_DEPTH. A ValueError
    (json.JSONDecodeError included) says what is wrong; too deep is the InvalidRequest."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("the text holds a lone surrogate") from None
    check_depth(text)  # first: json.loads recurses (RecursionError, not a ValueError)
    value = json.loads(text, parse_constant=_no_constant, parse_int=_bounded_int)
    if _has_lone_surrogate(value):
        raise ValueError("a string holds a lone surrogate (an unpaired \\ud800-\\udfff escape)")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _bounded_int(digits: str) -> int:
    if len(digits) > 21 or not INT_RANGE[0] <= int(digits) <= INT_RANGE[1]:
        raise ValueError(f"the integer {digits[:24]} does not fit in 64 bits")
    return int(digits)


def _has_lone_surrogate(value: object) -> bool:
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(item) for item in value)
    return False
