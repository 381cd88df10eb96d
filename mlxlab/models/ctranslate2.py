"""Read a CTranslate2 `model.bin` (the format faster-whisper's models ship in) into numpy arrays.

The layout, as CTranslate2's `ModelSpec.save` writes it (binary version 6, little-endian):

    u32 version | str spec name | u32 spec revision | u32 n_variables
    n_variables x ( str name | u8 rank | u32 dim x rank | u8 dtype | u32 n_bytes | bytes )
    u32 n_aliases | n_aliases x ( str alias | str variable name )

where `str` is a u16 length (with the terminating NUL) then the UTF-8 bytes and a NUL, and
dtype is CTranslate2's DataType: 0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16.
Scalars (rank 0) are the spec's settings (`decoder/num_heads`, ...). Arrays are views into the
file's bytes (read once); aliases (a tied output projection) map to their variable.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlxlab.errors import UserError

DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: "bfloat16"}
VERSIONS = (5, 6)


@dataclass
class CT2Model:
    spec: str  # e.g. "WhisperSpec"
    revision: int
    variables: dict[str, np.ndarray]
    aliases: dict[str, str]

    def __getitem__(self, name: str) -> np.ndarray:
        return self.variables[self.aliases.get(name, name)]

    def scalar(self, name: str) -> int | float:
        return self[name].reshape(()).item()


class _Reader:
    def __init__(self, data: bytes, path: Path):
        self.data, self.path, self.at = data, path, 0

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise UserError(f"{self.path}: truncated CTranslate2 model (at byte {self.at})")
        value = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.take("<H")
        raw = self.data[self.at : self.at + n]
        if len(raw) != n or not n or raw[-1] != 0:
            raise UserError(f"{self.path}: corrupt CTranslate2 model (bad string at {self.at})")
        self.at += n
        return raw[:-1].decode("utf-8")


def read(path: str | Path) -> CT2Model:
    """Parse `path`; a UserError names what is wrong with a file that is not one."""
    path = Path(path)
    data = path.read_bytes()
    r = _Reader(data, path)
    version = r.take("<I")
    if version not in VERSIONS:
        raise UserError(
            f"{path}: not a CTranslate2 model.bin of a known version (found {version}, "
            f"read {', '.join(map(str, VERSIONS))})"
        )
    spec = r.string()
    revision = r.take("<I")
    variables: dict[str, np.ndarray] = {}
    for _ in range(r.take("<I")):
        name = r.string()
        rank = r.take("<B")
        shape = tuple(r.take("<I") for _ in range(rank))
        code, nbytes = r.take("<B"), r.take("<I")
        if code not in DTYPES:
            raise UserError(f"{path}: {name} has an unknown CTranslate2 dtype {code}")
        if r.at + nbytes > len(data):
            raise UserError(f"{path}: truncated CTranslate2 model (in {name})")
        if DTYPES[code] == "bfloat16":  # numpy has none: widen to float32 exactly
            raw = np.frombuffer(data, np.uint16, nbytes // 2, r.at).astype(np.uint32) << 16
            array = raw.view(np.float32)
        else:
            dtype = np.dtype(DTYPES[code])
            array = np.frombuffer(data, dtype, nbytes // dtype.itemsize, r.at)
        if array.size != int(np.prod(shape, dtype=np.int64)):
            raise UserError(f"{path}: {name}: {nbytes} bytes do not make shape {shape}")
        variables[name] = array.reshape(shape)
        r.at += nbytes
    aliases = {}
    if r.at < len(data):
        for _ in range(r.take("<I")):
            alias = r.string()
            aliases[alias] = r.string()
    if r.at != len(data):
        raise UserError(f"{path}: {len(data) - r.at} unexpected bytes after the model")
    return CT2Model(spec, revision, variables, aliases)


def write(path: str | Path, model: CT2Model) -> None:
    """The inverse of `read` (version 6): tests write small models with it."""
    codes = {np.dtype(v): k for k, v in DTYPES.items() if v != "bfloat16"}

    def string(s: str) -> bytes:
        raw = s.encode("utf-8") + b"\0"
        return struct.pack("<H", len(raw)) + raw

    out = [struct.pack("<I", 6), string(model.spec), struct.pack("<I", model.revision)]
    out.append(struct.pack("<I", len(model.variables)))
    for name, array in model.variables.items():
        array = np.asarray(array).copy(order="C")  # (ascontiguousarray makes scalars 1-d)
        out += [string(name), struct.pack("<B", array.ndim)]
        out += [struct.pack("<I", d) for d in array.shape]
        out += [struct.pack("<BI", codes[array.dtype], array.nbytes), array.tobytes()]
    out.append(struct.pack("<I", len(model.aliases)))
    for alias, name in model.aliases.items():
        out += [string(alias), string(name)]
    Path(path).write_bytes(b"".join(out))
