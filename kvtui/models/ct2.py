"""Read a CTranslate2 `model.bin` (binary format version 6) into numpy arrays, without ctranslate2.

The layout, as ctranslate2's own writer produces it (`ctranslate2/specs/model_spec.py`,
`ModelSpec._serialize`), all integers little-endian:

    uint32 binary_version            (6 here; versions 1-5 differ and are refused)
    string spec_name                 e.g. "WhisperSpec"
    uint32 spec_revision
    uint32 num_variables
    num_variables x {string name, uint8 rank, uint32 dims[rank], uint8 dtype_id, uint32 num_bytes,
                     num_bytes of row-major data}
    uint32 num_aliases
    num_aliases x {string alias, string variable_name}

where `string` is a uint16 length (counting a trailing NUL) followed by the UTF-8 bytes and the NUL,
and dtype_id indexes (float32, int8, int16, int32, float16, bfloat16) (`include/ctranslate2/types.h`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SUPPORTED_VERSION = 6
# bfloat16 has no numpy dtype: it is read as raw uint16 and widened by `as_float32`.
_DTYPES = (np.float32, np.int8, np.int16, np.int32, np.float16, "bfloat16")
_DTYPE_NAMES = ("float32", "int8", "int16", "int32", "float16", "bfloat16")


class CT2FormatError(ValueError):
    """The file is not a CTranslate2 model.bin this reader understands (one line saying why)."""


@dataclass
class CT2Model:
    """The variables of a CTranslate2 model file.

    Attributes:
        spec_name: the model spec, e.g. "WhisperSpec".
        spec_revision: the spec's revision number (WhisperSpec: 3).
        variables: name -> array in the file's dtype (float16 weights stay float16; scalars are
            0-d arrays; bfloat16 data as uint16 bits). Arrays are read-only views of the file's bytes.
        aliases: alias name -> the variable it stands for (e.g. Whisper's output projection ->
            the decoder's token embeddings, tied weights).
        dtypes: name -> "float32" | "int8" | "int16" | "int32" | "float16" | "bfloat16".
        read: the variable names `get` has returned so far (lets a converter check it used them all).
    """

    spec_name: str
    spec_revision: int
    variables: dict[str, np.ndarray] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    read: set[str] = field(default_factory=set)

    def get(self, name: str) -> np.ndarray:
        """A variable by name or alias.

        Raises:
            KeyError: neither a variable nor an alias.
        """
        name = self.aliases.get(name, name)
        value = self.variables[name]
        self.read.add(name)
        return value

    def as_float32(self, name: str) -> np.ndarray:
        """A variable widened to a new float32 array (exact for float16 and bfloat16)."""
        value = self.get(name)
        if self.dtypes[self.aliases.get(name, name)] == "bfloat16":
            return (value.astype(np.uint32) << 16).view(np.float32)
        return value.astype(np.float32)


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.offset = memoryview(data), 0

    def unpack(self, fmt: str):
        try:
            values = struct.unpack_from("<" + fmt, self.data, self.offset)
        except struct.error:
            raise CT2FormatError(f"file ends early at byte {self.offset}") from None
        self.offset += struct.calcsize("<" + fmt)
        return values if len(values) > 1 else values[0]

    def string(self) -> str:
        size = self.unpack("H")
        raw = bytes(self.data[self.offset:self.offset + size])
        if size < 1 or len(raw) != size or raw[-1] != 0:
            raise CT2FormatError(f"bad string at byte {self.offset}")
        self.offset += size
        return raw[:-1].decode("utf-8")

    def array(self, dtype_id: int, shape: tuple[int, ...], num_bytes: int) -> np.ndarray:
        if dtype_id >= len(_DTYPES):
            raise CT2FormatError(f"unknown dtype id {dtype_id} at byte {self.offset}")
        dtype = np.dtype(np.uint16 if _DTYPES[dtype_id] == "bfloat16" else _DTYPES[dtype_id])
        count = int(np.prod(shape, dtype=np.int64))
        if count * dtype.itemsize != num_bytes or self.offset + num_bytes > len(self.data):
            raise CT2FormatError(f"variable of shape {shape} does not fit its {num_bytes} bytes")
        value = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.offset).reshape(shape)
        self.offset += num_bytes
        return value


def read_ct2(path: Path) -> CT2Model:
    """Parse a CTranslate2 model.bin (about 0.1 s for Whisper tiny.en's 75.5 MB).

    Raises:
        OSError: the file cannot be read.
        CT2FormatError: not binary version 6, truncated, or trailing bytes.
    """
    reader = _Reader(Path(path).read_bytes())
    version = reader.unpack("I")
    if version != SUPPORTED_VERSION:
        raise CT2FormatError(f"CTranslate2 binary version {version}, this reader knows version {SUPPORTED_VERSION}")
    model = CT2Model(spec_name=reader.string(), spec_revision=reader.unpack("I"))
    for _ in range(reader.unpack("I")):
        name = reader.string()
        rank = reader.unpack("B")
        shape = tuple(int(reader.unpack("I")) for _ in range(rank))
        dtype_id, num_bytes = reader.unpack("B"), reader.unpack("I")
        model.variables[name] = reader.array(dtype_id, shape, num_bytes)
        model.dtypes[name] = _DTYPE_NAMES[dtype_id]
    for _ in range(reader.unpack("I")):
        alias = reader.string()
        model.aliases[alias] = reader.string()
    if reader.offset != len(reader.data):
        raise CT2FormatError(f"{len(reader.data) - reader.offset} unread bytes after the last alias")
    return model
