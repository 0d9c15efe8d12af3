"""safetensors files, read and written in one place: the checkpoint's headers (the C++ side maps the files at the
offsets found here), the converter's and the synthetic writer's shards, and session files.

The `safetensors` package is not used at run time, for measured and structural reasons (safetensors 0.8.0, on
synthetic:medium's 357 tensors): its Python API exposes no data offsets, which the C++
side needs to map the weights in place (safe_open gives dtype and shape only; parsing all of medium's headers
took 0.73 ms with it and 1.3 ms here, while read_checkpoint takes 2-8 ms and the engine 23-53 ms to start,
with RSS 77 MB for medium's 755 MB of mapped weights, so nothing is gained by parsing the headers twice);
its numpy API refuses BF16 (numpy has no bfloat16: the 4-bit layouts' scales and the KV state are BF16), where
here BF16 comes back as its uint16 bits; serialize_file needs every tensor in memory at once (19.5 GB for
synthetic:full), where ShardedWriter streams row ranges into preallocated shards; and its low-level serialize
API takes raw pointers (TensorSpec) in 0.8 where earlier versions took dicts of bytes. The tests read
what this module writes back with the package (tests/test_convert.py), an independent reader.

Every check names the file and the tensor: a truncated file, a header whose offsets leave the file or disagree
with dtype x shape, overlapping tensors.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

# BF16 is read and written as its uint16 bits.
NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
                "U32": np.uint32, "I32": np.int32, "I64": np.int64, "U8": np.uint8, "I8": np.int8,
                "U16": np.uint16, "I16": np.int16, "BOOL": np.bool_, "U64": np.uint64}
DTYPE_SIZE = {k: np.dtype(v).itemsize for k, v in NUMPY_DTYPES.items()}
MAX_HEADER = 100 << 20  # a safetensors header larger than this is corrupt, not a model

TensorSpec = Tuple[str, Tuple[int, ...], str]  # (name, shape, safetensors dtype)


@dataclass
class Entry:
    """One tensor of a header: where its bytes lie in the file."""
    dtype: str
    shape: Tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: Path, error: type[Exception] = ValueError) -> tuple[dict[str, Entry], dict]:
    """Parses and checks one safetensors header without reading tensor data: {name: Entry} in header order
    and the __metadata__ dict. Rejects a truncated file, a header whose offsets leave the file or disagree with
    dtype × shape, and overlapping tensors, raising `error` naming the file and the tensor."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise error(f"{path}: truncated safetensors file ({size} bytes, no header length)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise error(f"{path}: header length {n} does not fit the file ({size} bytes): truncated or not safetensors")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise error(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise error(f"{path}: header is not a JSON object")
    base = 8 + n
    out: dict[str, Entry] = {}
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise error(f"{path}: tensor {name}: malformed header entry {info!r}") from None
        if any(d < 0 for d in shape) or not (0 <= b <= e):
            raise error(f"{path}: tensor {name}: invalid shape {shape} or offsets [{b}, {e}]")
        if dtype in DTYPE_SIZE and e - b != math.prod(shape) * DTYPE_SIZE[dtype]:
            raise error(f"{path}: tensor {name}: header says {dtype}{list(shape)} "
                                  f"({math.prod(shape) * DTYPE_SIZE[dtype]} bytes) but its offsets span {e - b} bytes")
        if base + e > size:
            raise error(f"{path}: tensor {name} ends at byte {base + e} but the file has {size} bytes (truncated)")
        spans.append((b, e, name))
        out[name] = Entry(dtype, shape, base + b, e - b)
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise error(f"{path}: tensors {n0} and {n1} overlap in the file (header is inconsistent)")
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise error(f"{path}: __metadata__ is not a JSON object")
    return out, metadata


class SafetensorsFile:
    """Read-only, memory-mapped safetensors file (its header checked by read_header). BF16 tensors come back as
    uint16 bits."""

    def __init__(self, path: Union[str, Path]):
        self.path = Path(path)
        self.entries, self.metadata = read_header(self.path)
        self._mm = None

    def keys(self) -> List[str]:
        return list(self.entries)

    def info(self, name: str) -> Tuple[str, Tuple[int, ...]]:
        e = self.entries[name]
        return e.dtype, e.shape

    def get(self, name: str) -> np.ndarray:
        """Zero-copy view (read-only memmap) of a tensor."""
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        e = self.entries[name]
        return self._mm[e.offset:e.offset + e.nbytes].view(NUMPY_DTYPES[e.dtype]).reshape(e.shape)

    def close(self):
        self._mm = None


class ShardedWriter:
    """Streaming sharded safetensors writer driven by a plan.

    ``plan``: ordered (name, shape, dtype) list.  Tensors are assigned to shards
    in plan order with mlx-lm's rule (new shard when the current one would exceed
    ``max_shard_bytes``); every file is created up front with its final header
    and size, and tensor data is then written with positional writes, whole or
    as row ranges (``write(name, array, row0)``), in any order.  ``close()``
    checks that every byte was written and writes ``model.safetensors.index.json``.
    """

    def __init__(self, out_dir: Union[str, Path], plan: Sequence[TensorSpec],
                 max_shard_bytes: int = 5 << 30, metadata: Optional[dict] = None,
                 index_metadata: Optional[dict] = None, single_name: str = "model.safetensors"):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.specs: Dict[str, Tuple[Tuple[int, ...], str]] = {}
        shards: List[List[TensorSpec]] = []
        size = 0
        for name, shape, dt in plan:
            if name in self.specs:
                raise ValueError(f"duplicate tensor {name}")
            shape = tuple(int(s) for s in shape)
            nb = int(np.prod(shape, dtype=np.int64)) * DTYPE_SIZE[dt]
            if not shards or size + nb > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, shape, dt))
            size += nb
            self.specs[name] = (shape, dt)
        if not shards:
            shards.append([])
        count = len(shards)
        self.files = {}
        self.loc: Dict[str, Tuple[int, int, int]] = {}  # name -> (file idx, abs offset, nbytes)
        self.weight_map: Dict[str, str] = {}
        self.total_size = 0
        self._written: Dict[str, int] = {}
        self._fds = []
        meta = {"format": "mlx"} if metadata is None else metadata
        for i, shard in enumerate(shards):
            fname = single_name if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            header = {"__metadata__": meta} if meta else {}
            off = 0
            for name, shape, dt in shard:
                nb = int(np.prod(shape, dtype=np.int64)) * DTYPE_SIZE[dt]
                header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + nb]}
                off += nb
            hb = json.dumps(header, separators=(",", ":")).encode()
            hb += b" " * (-len(hb) % 8)
            base = 8 + len(hb)
            path = self.out_dir / fname
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, struct.pack("<Q", len(hb)) + hb)
            os.ftruncate(fd, base + off)
            self._fds.append(fd)
            for name, shape, dt in shard:
                a, b = header[name]["data_offsets"]
                self.loc[name] = (i, base + a, b - a)
                self.weight_map[name] = fname
                self._written[name] = 0
            self.total_size += off
        self.index_metadata = index_metadata or {}

    def write(self, name: str, arr: np.ndarray, row0: int = 0):
        """Write ``arr`` as rows [row0, row0 + len(arr)) (first axis) of tensor ``name``."""
        shape, dt = self.specs[name]
        arr = np.ascontiguousarray(arr)
        if np.dtype(NUMPY_DTYPES[dt]) != arr.dtype:
            raise TypeError(f"{name}: expected {dt}, got {arr.dtype}")
        if arr.shape == shape:
            row0 = 0
            row_bytes = 0
        else:
            if tuple(arr.shape[1:]) != tuple(shape[1:]) or row0 + arr.shape[0] > shape[0]:
                raise ValueError(f"{name}: slice {arr.shape} at {row0} does not fit {shape}")
            row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * DTYPE_SIZE[dt]
        fi, off, nb = self.loc[name]
        data = memoryview(arr.reshape(-1).view(np.uint8))
        pos = off + row0 * row_bytes
        while len(data):
            k = os.pwrite(self._fds[fi], data, pos)
            data = data[k:]
            pos += k
        self._written[name] += arr.nbytes

    def close(self, write_index: bool = True):
        missing = [k for k, (_, _, nb) in self.loc.items() if self._written[k] != nb]
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        if missing:
            raise RuntimeError(f"{len(missing)} tensors not fully written, e.g. {missing[:3]}")
        if write_index:
            idx = {"metadata": {"total_size": self.total_size, **self.index_metadata},
                   "weight_map": {k: self.weight_map[k] for k in sorted(self.weight_map)}}
            with open(self.out_dir / "model.safetensors.index.json", "w") as f:
                json.dump(idx, f, indent=4)


def write_file(path: Path, tensors: Sequence[Tuple[str, str, Sequence[int], bytes]], metadata: dict) -> None:
    """One safetensors file of (name, dtype, shape, bytes), written to a temporary name and then renamed, so that
    a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    w = ShardedWriter(path.parent, [(n, tuple(s), dt) for n, dt, s, _ in tensors], max_shard_bytes=1 << 62,
                      metadata=metadata, single_name=tmp.name)
    for name, dt, shape, data in tensors:
        w.write(name, np.frombuffer(data, NUMPY_DTYPES[dt]).reshape(shape))
    w.close(write_index=False)
    os.replace(tmp, path)
