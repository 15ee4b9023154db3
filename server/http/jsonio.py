"""The one JSON codec of the code base (orjson).

`loads` reads user JSON: besides orjson's own refusals (NaN/Infinity, lone surrogates, invalid
UTF-8) it refuses nesting deeper than `MAX_JSON_DEPTH` (an InvalidRequest naming the limit), so
everything it returns can be written back by `dumps`. orjson reads integers beyond 64 bits as
floats, which `dumps` writes back too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import orjson

from server.core.json_limits import check_depth

JSONDecodeError = orjson.JSONDecodeError


# a partial, not a function: it runs for every streamed event, and a partial adds no frame
dumps: Callable[[Any], bytes] = functools.partial(orjson.dumps, option=orjson.OPT_NON_STR_KEYS)
# A str, number, bool or None (nothing with keys): orjson itself, for the per-event templates of
# streams; the partial's keyword argument costs ~90 ns a call, more than writing a token's text.
dumps_scalar: Callable[[str | float | None], bytes] = orjson.dumps


def loads(data: bytes | str) -> Any:
    value = orjson.loads(data)
    if isinstance(value, dict | list):
        check_depth(data)
    return value


def pretty(value: Any) -> bytes:
    """Two-space indented JSON (DJL's Gson pretty printing), without a trailing newline."""
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_INDENT_2)
