"""A GGUF file's metadata and tensor table, parsed in one pass over the header.

gguf-py's `GGUFReader` builds a numpy view per part of every field: the embedded model's
tokenizer (49,152 tokens and 48,900 merges) takes it ~4.7 s of the ~6.8 s a model load costs,
paid by every worker, front and CLI that starts. This reads the same header with `struct` over
the file's bytes (~0.1 s) and maps the tensor data as GGUFReader does (read-only views of the
file); tensor types and dequantization stay gguf-py's (`gguf.GGMLQuantizationType`,
`gguf.quants`). Values come out as GGUFReader's `ReaderField.contents()` gives them (tests
compare the two on every file they load).

Layout (little-endian, versions 2 and 3): magic "GGUF", u32 version, u64 tensor count, u64
metadata count; each metadata entry a string key, a u32 value type and the value (an array is
an element type, a u64 count and the elements); each tensor a string name, u32 dimension
count, u64 dimensions (innermost first), u32 type, u64 offset into the data section, which
starts at the next multiple of `general.alignment` (32 when absent) after the table.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# metadata value types (the GGUF spec's numbering) -> struct format
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9

# tensor types stored as plain numbers (the rest are byte rows of quantized blocks)
_PLAIN_TENSORS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                  "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # as the file lists the dimensions: innermost first
    data: np.ndarray  # read-only view of the file: numbers for plain types, byte rows for quantized ones


@dataclass(frozen=True)
class GGUFFile:
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


class _Cursor:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: Any):
        self.buf = buf
        self.pos = 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        s = bytes(self.buf[self.pos:end]).decode("utf-8", errors="replace")
        self.pos = end
        return s

    def value(self, kind: int) -> Any:
        if kind in _SCALAR:
            return self.take(_SCALAR[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        raise ValueError(f"unknown metadata value type {kind}")

    def array(self) -> list[Any]:
        kind, n = self.take("<I"), self.take("<Q")
        if kind in _NUMPY:
            dtype = np.dtype(_NUMPY[kind])
            end = self.pos + n * dtype.itemsize
            if end > len(self.buf):
                raise ValueError(f"an array of {n} values runs past the end of the file")
            values = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).tolist()
            self.pos = end
            return values
        if kind == _STRING:
            out = []
            buf, pos, unpack = self.buf, self.pos, struct.Struct("<Q").unpack_from
            for _ in range(n):
                size = unpack(buf, pos)[0]
                pos += 8
                out.append(bytes(buf[pos:pos + size]).decode("utf-8", errors="replace"))
                pos += size
            if pos > len(buf):
                raise ValueError(f"an array of {n} strings runs past the end of the file")
            self.pos = pos
            return out
        return [self.value(kind) for _ in range(n)]


def read_gguf(path: Path | str) -> GGUFFile:
    """The file's metadata (plain Python values) and its tensors (views of the mapped file).
    Raises ValueError for anything that is not a readable GGUF file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # an empty file cannot be mapped
            raise ValueError(f"cannot map the file ({exc})") from exc
    cur = _Cursor(buf)
    if bytes(buf[:4]) != MAGIC:
        raise ValueError(f"bad magic {bytes(buf[:4])!r}")
    cur.pos = 4
    version = cur.take("<I")
    if version not in VERSIONS:
        raise ValueError(f"GGUF version {version} is not supported (little-endian versions {VERSIONS} are)")
    n_tensors, n_fields = cur.take("<Q"), cur.take("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_fields):
        key = cur.string()
        metadata[key] = cur.value(cur.take("<I"))
    table = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.take("<Q") for _ in range(cur.take("<I")))
        table.append((name, dims, cur.take("<I"), cur.take("<Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0:
        raise ValueError(f"general.alignment is {alignment}")
    start = -(-cur.pos // alignment) * alignment
    data = np.frombuffer(buf, dtype=np.uint8)
    tensors, seen = [], set()
    for name, dims, raw_type, offset in table:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice")
        seen.add(name)
        kind = GGMLQuantizationType(raw_type)
        n_elems = int(np.prod(dims)) if dims else 1
        block, type_size = GGML_QUANT_SIZES[kind]
        np_dims = tuple(reversed(dims))
        begin = start + offset
        raw = data[begin:begin + n_elems * type_size // block]
        plain = _PLAIN_TENSORS.get(kind.name)
        if plain is not None:
            values = raw[:len(raw) - len(raw) % np.dtype(plain).itemsize].view(plain)
            array = values.reshape(np_dims) if values.size == n_elems else values
        else:
            byte_dims = quant_shape_to_byte_shape(np_dims, kind)
            array = raw.reshape(byte_dims) if raw.size == int(np.prod(byte_dims)) else raw
        tensors.append(GGUFTensor(name, kind, dims, array))
    return GGUFFile(version, metadata, tensors)
