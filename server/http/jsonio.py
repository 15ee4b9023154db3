"""The one JSON codec of the code base (orjson)."""

from __future__ import annotations

from typing import Any

import orjson

JSONDecodeError = orjson.JSONDecodeError


def dumps(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)


def loads(data: bytes | str) -> Any:
    return orjson.loads(data)


def pretty(value: Any) -> bytes:
    """Two-space indented JSON (DJL's Gson pretty printing), without a trailing newline."""
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_INDENT_2)
