"""KServe v2 tensors: datatypes, JSON `data`, and Triton's binary tensor data extension.

Owns the byte-level codec (no HTTP, no model knowledge):
- a request body is a JSON header optionally followed by raw tensor bytes; the header's length is
  the `Inference-Header-Content-Length` request header (`split_body`);
- raw tensor bytes are little-endian, row-major; BOOL is one byte; BYTES is, per element, a 4-byte
  little-endian length and the bytes (`from_binary`, `to_binary`);
- JSON `data` may be nested or flat and must match the shape's element count (`from_json`);
- a response is the JSON header then the binary outputs in output order (`encode_response`).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from server.core.errors import InvalidRequest, PayloadTooLarge
from server.core.frozen import quick_init
from server.http import jsonio

HEADER_LENGTH = "inference-header-content-length"

TensorValue = bool | int | float | bytes


@dataclass(frozen=True, slots=True)
class DataType:
    name: str  # KServe spelling: "UINT32"
    config_name: str  # Triton ModelConfig spelling: "TYPE_UINT32"
    code: str  # struct format character ("" for BYTES and BF16)
    size: int  # bytes per element (0 for BYTES)
    kind: str  # "bool" | "uint" | "int" | "float" | "bytes"


def _dtypes() -> dict[str, DataType]:
    table = [
        ("BOOL", "TYPE_BOOL", "?", 1, "bool"),
        ("UINT8", "TYPE_UINT8", "B", 1, "uint"), ("UINT16", "TYPE_UINT16", "H", 2, "uint"),
        ("UINT32", "TYPE_UINT32", "I", 4, "uint"), ("UINT64", "TYPE_UINT64", "Q", 8, "uint"),
        ("INT8", "TYPE_INT8", "b", 1, "int"), ("INT16", "TYPE_INT16", "h", 2, "int"),
        ("INT32", "TYPE_INT32", "i", 4, "int"), ("INT64", "TYPE_INT64", "q", 8, "int"),
        ("FP16", "TYPE_FP16", "e", 2, "float"), ("FP32", "TYPE_FP32", "f", 4, "float"),
        ("FP64", "TYPE_FP64", "d", 8, "float"), ("BF16", "TYPE_BF16", "", 2, "float"),
        ("BYTES", "TYPE_STRING", "", 0, "bytes"),
    ]
    return {row[0]: DataType(*row) for row in table}


DATATYPES = _dtypes()
_JSON_KIND = {
    "bool": "attempt to access JSON non-boolean as boolean",
    "uint": "attempt to access JSON non-unsigned-integer as unsigned-integer",
    "int": "attempt to access JSON non-signed-integer as signed-integer",
    "float": "attempt to access JSON non-number as number",
    "bytes": "attempt to access JSON non-string as string",
}


@quick_init
@dataclass(frozen=True, slots=True)
class Tensor:
    """One tensor, flattened row-major. BYTES elements are `bytes`."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: tuple[TensorValue, ...]


def datatype(name: str, tensor: str) -> DataType:
    found = DATATYPES.get(name)
    if found is None:
        raise InvalidRequest(f"invalid datatype '{name}' for tensor '{tensor}'")
    return found


def element_count(shape: Sequence[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


# ---- request body ---------------------------------------------------------------------------
def split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes | None]:
    """Split a request body into (JSON header, binary tensor bytes or None without the header).

    Without the header the whole body is JSON, as in Triton. `0` announces a "raw binary request"
    (one input's bytes, no JSON), which Triton allows only for single-input models; ours have
    several inputs, so it is refused.
    """
    if header_length is None:
        return body, None
    text = header_length.strip()
    if not text.isdigit():
        raise InvalidRequest(
            f"Unable to parse Inference-Header-Content-Length, got: {header_length}"
        )
    length = int(text)
    if length > len(body):
        raise InvalidRequest(
            f"inference header size should be in range (0, {len(body)}), got: {header_length}"
        )
    if length == 0:
        raise InvalidRequest(
            "raw binary requests (Inference-Header-Content-Length: 0) are only allowed for a "
            "model with a single input; send a JSON inference header"
        )
    return body[:length], body[length:]


def inflate(body: bytes, encoding: str | None, limit: int) -> bytes:
    """Undo `Content-Encoding: gzip|deflate` (tritonclient's request compression), bounded."""
    name = (encoding or "identity").strip().lower()
    if name == "identity":
        return body
    if name not in ("gzip", "deflate"):
        raise InvalidRequest(
            f"Unsupported content-encoding '{encoding}', only 'identity', 'gzip' and 'deflate' "
            "are supported"
        )
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if name == "gzip" else zlib.MAX_WBITS)
    try:
        data = inflater.decompress(body, limit + 1)
    except zlib.error:
        raise InvalidRequest(f"the request body is not valid {name} data") from None
    if len(data) > limit:
        raise PayloadTooLarge(f"Request body is larger than the limit of {limit} bytes")
    return data


def from_json(name: str, dtype: DataType, shape: tuple[int, ...], data: Any) -> Tensor:
    """A tensor from JSON `data` (nested or flat), checking element types and count."""
    values = tuple(_json_value(name, dtype, item) for item in _flatten(data))
    expected = element_count(shape)
    if len(values) != expected:
        raise InvalidRequest(
            f"Unable to parse 'data' of input '{name}': shape {list(shape)} expects {expected} "
            f"element(s) but 'data' has {len(values)}"
        )
    return Tensor(name, dtype.name, shape, values)


def _flatten(data: Any) -> Iterator[Any]:
    if isinstance(data, list):
        for item in data:
            yield from _flatten(item)
    else:
        yield data


def _json_value(name: str, dtype: DataType, item: Any) -> TensorValue:
    kind = dtype.kind
    ok = (
        (kind == "bool" and isinstance(item, bool))
        or (kind == "bytes" and isinstance(item, str))
        or (kind in ("uint", "int") and isinstance(item, int) and not isinstance(item, bool))
        or (kind == "float" and isinstance(item, int | float) and not isinstance(item, bool))
    )
    if not ok:
        raise InvalidRequest(f"Unable to parse 'data' of input '{name}': {_JSON_KIND[kind]}")
    if kind == "bytes":
        return str(item).encode()
    if kind in ("uint", "int"):
        _check_range(name, dtype, item)
    return item  # type: ignore[no-any-return]


def _check_range(name: str, dtype: DataType, value: int) -> None:
    bits = dtype.size * 8
    if dtype.kind == "uint":
        low, high = 0, 2**bits - 1
    else:
        low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if not low <= value <= high:
        raise InvalidRequest(
            f"Unable to parse 'data' of input '{name}': value {value} is out of range "
            f"for {dtype.name}"
        )


def from_binary(name: str, dtype: DataType, shape: tuple[int, ...], raw: bytes) -> Tensor:
    """A tensor from its raw bytes (binary tensor data extension)."""
    expected = element_count(shape)
    if dtype.kind == "bytes":
        values: tuple[TensorValue, ...] = tuple(_bytes_elements(name, raw))
        if len(values) != expected:
            raise InvalidRequest(
                f"unexpected number of string elements {len(values)} for input '{name}', "
                f"expecting {expected}"
            )
        return Tensor(name, dtype.name, shape, values)
    if len(raw) != expected * dtype.size:
        raise InvalidRequest(
            f"unexpected total byte size {len(raw)} for input '{name}', "
            f"expecting {expected * dtype.size}"
        )
    if dtype.name == "BF16":
        values = tuple(_bf16(raw[i : i + 2]) for i in range(0, len(raw), 2))
    else:
        values = struct.unpack(f"<{expected}{dtype.code}", raw)
    return Tensor(name, dtype.name, shape, values)


def _bf16(two: bytes) -> float:
    value: float = struct.unpack("<f", b"\0\0" + two)[0]
    return value


def _bytes_elements(name: str, raw: bytes) -> Iterator[bytes]:
    offset = 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise InvalidRequest(f"incomplete string length for input '{name}'")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise InvalidRequest(
                f"incomplete string data for input '{name}', expecting {length} bytes but only "
                f"{len(raw) - offset} remain"
            )
        yield raw[offset : offset + length]
        offset += length


def to_binary(tensor: Tensor) -> bytes:
    dtype = DATATYPES[tensor.datatype]
    if dtype.kind == "bytes":
        return b"".join(
            struct.pack("<I", len(item)) + item for item in tensor.data if isinstance(item, bytes)
        )
    if dtype.name == "BF16":
        return b"".join(struct.pack("<f", float(v))[2:] for v in tensor.data)
    return struct.pack(f"<{len(tensor.data)}{dtype.code}", *tensor.data)


def to_json_data(tensor: Tensor) -> list[Any]:
    """Flat JSON `data` (KServe allows flat data for any shape). BYTES become UTF-8 strings."""
    if tensor.datatype == "BYTES":
        return [v.decode(errors="replace") if isinstance(v, bytes) else v for v in tensor.data]
    return list(tensor.data)


# ---- response body --------------------------------------------------------------------------
def encode_response(
    header: Mapping[str, Any], outputs: Sequence[Tensor], binary: frozenset[str]
) -> tuple[bytes, int | None]:
    """Encode an infer response; outputs named in `binary` go after the JSON header as raw bytes.

    Returns (body, header length). The header length is None when no binary bytes follow, so
    the response is plain JSON (Triton sets Inference-Header-Content-Length only then).
    """
    entries: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for tensor in outputs:
        entry: dict[str, Any] = {
            "name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape),
        }
        if tensor.name in binary:
            blob = to_binary(tensor)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = to_json_data(tensor)
        entries.append(entry)
    head = jsonio.dumps({**header, "outputs": entries})
    if not any(blobs):
        return head, None
    return head + b"".join(blobs), len(head)
