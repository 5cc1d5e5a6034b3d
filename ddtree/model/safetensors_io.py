"""safetensors files read lazily and written as a stream, with bf16 carried as uint16 bits.

Tensors are read by the `safetensors` library (`safe_open(framework="numpy")`; with `ml_dtypes`
installed its numpy reader holds BF16 as ml_dtypes.bfloat16, which `read` views as the uint16 bits
the rest of ddtree carries). The header is also parsed here, with the library's own checks
(tests/model/test_safetensors_strict.py), because two readers need what the library does not expose:
each tensor's byte offsets (engine_dir/tensors.py hashes a file while reading it; builder/tensor_io.py
reads row blocks) and refusals that name the file and the field. The format:
  u64 little-endian N | N bytes of JSON header (space padded) | data buffer
  header: {name: {"dtype", "shape", "data_offsets": [begin, end)}, "__metadata__": {...}}
Writing stays here: the library writes a whole dict of arrays at once, this writer takes the full
list of specs first, writes the header, then tensor bytes in order, so a shard is never whole in
memory. Files written here load with the `safetensors` package (tests check that).
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from pathlib import Path
from typing import Iterable

import numpy as np
from safetensors import safe_open

from ddtree.errors import InputError
from ddtree.model.tensors import TensorSpec

# safetensors dtype -> numpy dtype as we hold it in memory (BF16 as raw uint16 bits)
NUMPY_DTYPE = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
               "I8": np.int8, "U8": np.uint8, "I16": np.int16, "U16": np.uint16, "I32": np.int32,
               "U32": np.uint32, "I64": np.int64, "U64": np.uint64, "BOOL": np.bool_}
# every dtype the safetensors format defines (library 0.8), in bits: the ones not in NUMPY_DTYPE
# (fp8, fp6, fp4, complex) are valid files this reader refuses as unsupported, not as corrupt
FORMAT_DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
                     "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
                     "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64,
                     "I64": 64, "U64": 64}
MAX_HEADER = 100_000_000          # bytes of JSON header, the library's limit
MAX_JSON_DEPTH = 127              # nesting the library's JSON parser (serde_json) accepts
U64 = 1 << 64                     # sizes, offsets and shape entries are u64 (usize) in the format
F64_INT_LIMIT = 1 << 1024         # serde_json reads an integer past 64 bits as an f64: past this, out of range
ITEMSIZE = {k: np.dtype(v).itemsize for k, v in NUMPY_DTYPE.items()}
INTP_MAX = int(np.iinfo(np.intp).max)
TENSOR_FIELDS = ("dtype", "shape", "data_offsets")


class CheckpointError(InputError):
    """A checkpoint file is missing, corrupt, or disagrees with the index or the config."""


class _BadJson(ValueError):
    """JSON that Python's parser takes but the safetensors library's (serde_json) refuses."""


class _SignedInt(int):
    """An integer literal written with a minus sign (even -0): never a size, a dimension or an offset."""

    def __repr__(self) -> str:
        return f"-{-self}" if self <= 0 else int.__repr__(self)


def _json_int(text: str) -> int:
    if len(text) > 320:               # past f64 (int() itself refuses past 4300 digits)
        raise _BadJson(f"integer {text[:12]}... out of range")
    v = int(text)
    return _SignedInt(v) if text.startswith("-") else v


def _json_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise _BadJson(f"number {text} out of range")
    return v


def _json_constant(text: str):
    raise _BadJson(f"{text} is not JSON")


def _json_object(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _BadJson(f"duplicate key {dup!r}")
    return out


def _check_strings(value) -> None:
    """serde_json refuses a lone UTF-16 surrogate escape (\\ud800) that Python's json decodes."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise _BadJson(f"string {value[:40]!r} holds a lone UTF-16 surrogate escape") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k)
            _check_strings(v)
    elif isinstance(value, list):
        for v in value:
            _check_strings(v)


def _check_extra(value, depth: int, where) -> None:
    """A field the library ignores, which serde_json must still parse: nesting within its limit,
    integers within f64 range (the one place a valid header may hold either)."""
    if isinstance(value, int) and abs(value) >= F64_INT_LIMIT:
        raise CheckpointError(f"{where}: corrupt safetensors header (an integer past the f64 range)")
    if isinstance(value, (dict, list)):
        if depth > MAX_JSON_DEPTH:
            raise CheckpointError(f"{where}: corrupt safetensors header (JSON nested deeper than "
                                  f"{MAX_JSON_DEPTH} levels)")
        for v in value.values() if isinstance(value, dict) else value:
            _check_extra(v, depth + 1, where)


# what sends a header to the exact, slower parse: -0 (a float to serde_json, so never an offset) and
# \\u escapes of surrogates. Rare in real headers; a false match only costs time.
_NEGATIVE_ZERO = re.compile(r"-0(?![.eE0-9])")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _is_u64(x) -> bool:
    return type(x) is int and 0 <= x < U64         # not bool, not a float, not a negative literal


def parse_header(raw: bytes, where) -> tuple[dict[str, str], dict]:
    """Header bytes -> (metadata, {name: tensor entry}) with the JSON refused as the library refuses
    it: not UTF-8, not one JSON object (serde_json's grammar: no NaN, numbers in range, no lone
    surrogates), `__metadata__` not null or an object of strings. Duplicate keys are refused too
    (the library keeps the last of two tensors of one name; we do not guess). The entries are
    checked by _tensor_spec."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{where}: corrupt safetensors header (not UTF-8: {e})") from e
    exact = ("-0" in text and _NEGATIVE_ZERO.search(text) is not None) or \
        ("\\u" in text and _SURROGATE_ESCAPE.search(text) is not None)
    try:
        header = json.loads(text, object_pairs_hook=_json_object, parse_float=_json_float,
                            parse_constant=_json_constant, **({"parse_int": _json_int} if exact else {}))
        if exact:
            _check_strings(header)
    except RecursionError:
        raise CheckpointError(f"{where}: corrupt safetensors header (JSON nested deeper than "
                              f"{MAX_JSON_DEPTH} levels)") from None
    except ValueError as e:        # json.JSONDecodeError, _BadJson, int() refusing a huge literal
        raise CheckpointError(f"{where}: corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: corrupt safetensors header (a JSON {type(header).__name__}, "
                              "expected an object of tensors)")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{where}: corrupt safetensors header (__metadata__ is {metadata!r}, "
                              "expected an object of strings)")
    for k, v in metadata.items():
        if not isinstance(v, str):
            raise CheckpointError(f"{where}: corrupt safetensors header (__metadata__[{k!r}] is {v!r}, "
                                  "expected a string)")
    return metadata, header


def _corrupt(where, name: str) -> str:
    return f"{where}: corrupt safetensors header: tensor '{name}'"


def _tensor_spec(name: str, e, where) -> tuple[TensorSpec, tuple[int, int]]:
    """One header entry -> (spec, (begin, end)), each field checked as the library types it."""
    if type(e) is not dict:
        raise CheckpointError(f"{_corrupt(where, name)} is {e!r}, expected an object with "
                              f"{', '.join(TENSOR_FIELDS)}")
    if len(e) != len(TENSOR_FIELDS) or not all(f in e for f in TENSOR_FIELDS):
        missing = [f for f in TENSOR_FIELDS if f not in e]
        if missing:
            raise CheckpointError(f"{_corrupt(where, name)} lacks {', '.join(missing)}")
        for k, v in e.items():        # fields the library ignores, as JSON it must still parse
            if k not in TENSOR_FIELDS:
                _check_extra(v, 3, where)
    dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
    if type(dtype) is not str or dtype not in NUMPY_DTYPE:
        if not isinstance(dtype, str) or dtype not in FORMAT_DTYPE_BITS:
            raise CheckpointError(f"{_corrupt(where, name)} has dtype {dtype!r}, expected one of "
                                  f"{', '.join(FORMAT_DTYPE_BITS)}")
        raise CheckpointError(f"{where}: tensor '{name}' has unsupported dtype {dtype} (this reader holds "
                              f"{', '.join(NUMPY_DTYPE)})")
    if type(shape) is not list or not all(type(d) is int and 0 <= d < U64 for d in shape):
        raise CheckpointError(f"{_corrupt(where, name)} has shape {shape!r}, expected a list of integers "
                              "in 0..2^64-1")
    if type(offsets) is not list or len(offsets) != 2 or not (_is_u64(offsets[0]) and _is_u64(offsets[1])):
        raise CheckpointError(f"{_corrupt(where, name)} has data_offsets {offsets!r}, expected [begin, end], "
                              "integers in 0..2^64-1")
    count = 1
    for d in shape:                   # the library multiplies in u64 and refuses on overflow
        count *= d
        if count >= U64:
            raise CheckpointError(f"{_corrupt(where, name)} has shape {shape}: its element count "
                                  "overflows 64 bits")
    if count * FORMAT_DTYPE_BITS[dtype] >= U64:
        raise CheckpointError(f"{_corrupt(where, name)} has shape {shape}: its size in bits overflows 64 bits")
    if count == 0:                    # numpy's own size limit skips zero dims (the library's numpy
        held = ITEMSIZE[dtype]        # reader meets it too); a nonempty tensor that large is past
        for d in shape:               # the end of any file, refused by _check_layout
            held *= d or 1
        if held > INTP_MAX:
            raise CheckpointError(f"{where}: tensor '{name}' has shape {shape}: too large for a numpy array "
                                  f"(itemsize x nonzero dims past {INTP_MAX})")
    return TensorSpec(dtype, tuple(shape)), (offsets[0], offsets[1])


class SafetensorsFile:
    """One .safetensors file: header parsed and validated on open, tensors read on demand.

    The checks are the `safetensors` library's (tests/model/test_safetensors_strict.py compares
    the two on mutated files): u64 header length N <= 100,000,000 with 8 + N within the file; a
    header as parse_header takes it; each tensor's data_offsets hold exactly dtype size x shape
    bytes; sorted by offsets, the tensors tile the data buffer from 0 to the end of the file, with
    no overlap, no gap and no trailing byte. Stricter than the library only in refusing duplicate
    JSON keys and dtypes numpy cannot hold (fp8/fp6/fp4/complex)."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.exists():
            raise CheckpointError(f"{self.path}: shard file not found")
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: not a safetensors file (not a regular file)")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{self.path}: truncated file ({size} bytes, no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                raise CheckpointError(f"{self.path}: corrupt safetensors header (declares {n} header "
                                      f"bytes, more than the format's {MAX_HEADER})")
            if 8 + n > size:
                raise CheckpointError(f"{self.path}: corrupt safetensors header (declares {n} header "
                                      f"bytes, file has {size})")
            raw = f.read(n)
        self.metadata, header = parse_header(raw, self.path)
        self.data_start = 8 + n
        data_len = size - self.data_start
        self.entries: dict[str, TensorSpec] = {}
        self.offsets: dict[str, tuple[int, int]] = {}
        where = str(self.path)
        for name, e in header.items():
            self.entries[name], self.offsets[name] = _tensor_spec(name, e, where)
        self._check_layout(data_len, size)
        self._lib = None                # the library's handle (safe_open), opened on the first read

    def _check_layout(self, data_len: int, size: int) -> None:
        """Sorted by (begin, end), the tensors must tile [0, data_len) exactly (the library's rule)."""
        prev, end_prev = None, 0
        for name in sorted(self.offsets, key=lambda k: self.offsets[k]):
            b, end = self.offsets[name]
            spec = self.entries[name]
            where = f"{self.path}: tensor '{name}' data_offsets [{b}, {end})"
            if end < b:
                raise CheckpointError(f"{where}: begin is past end")
            if end - b != spec.nbytes:
                raise CheckpointError(f"{where} hold {end - b} bytes, expected {spec.nbytes} for "
                                      f"{spec.dtype} {list(spec.shape)}")
            if b < end_prev:
                pb, pe = self.offsets[prev]
                raise CheckpointError(f"{where} overlap tensor '{prev}' [{pb}, {pe}): expected tensors that "
                                      "tile the data buffer")
            if b > end_prev:
                before = f"after tensor '{prev}' (ends at {end_prev})" if prev else "at the start of the data"
                raise CheckpointError(f"{where} leave a gap of {b - end_prev} bytes {before}: expected "
                                      "tensors that tile the data buffer")
            prev, end_prev = name, end
        if end_prev > data_len:
            raise CheckpointError(f"{self.path}: truncated file: tensor '{prev}' ends at byte "
                                  f"{self.data_start + end_prev}, file has {size}")
        if end_prev < data_len:
            last = f"tensor '{prev}' ends at byte {self.data_start + end_prev}" if prev else \
                f"no tensors, data starts at byte {self.data_start}"
            raise CheckpointError(f"{self.path}: {data_len - end_prev} bytes of trailing data ({last}, file "
                                  f"has {size}): expected the tensors to end where the file ends")

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def keys(self):
        return self.entries.keys()

    def read(self, name: str) -> np.ndarray:
        """One tensor as the library reads it (BF16 as its uint16 bits); only its bytes of the file are read."""
        if name not in self.entries:
            raise CheckpointError(f"{self.path}: tensor '{name}' is not in this shard")
        spec = self.entries[name]
        if spec.dtype == "BF16":
            try:
                import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy: the library's numpy reader needs it)
            except ImportError as e:
                raise CheckpointError(f"{self.path}: tensor '{name}' is BF16, which the safetensors library reads "
                                      "into numpy only with ml_dtypes (a dependency of ddtree: pip install "
                                      "ml-dtypes)") from e
        if self._lib is None:
            self._lib = safe_open(str(self.path), framework="numpy")
        try:
            arr = self._lib.get_tensor(name)
        except Exception as e:  # noqa: BLE001 - the library's SafetensorError / OSError, re-raised naming the file
            raise CheckpointError(f"{self.path}: tensor '{name}': the safetensors library could not read it: "
                                  f"{type(e).__name__}: {e}") from e
        want = np.dtype(NUMPY_DTYPE[spec.dtype])
        if arr.dtype != want:                       # BF16: ml_dtypes.bfloat16 -> the same bits as uint16
            arr = arr.view(want)
        return np.ascontiguousarray(arr.reshape(spec.shape))

    def close(self):
        self._lib = None


def header_bytes(specs: dict[str, TensorSpec], metadata: dict | None) -> tuple[bytes, dict[str, int]]:
    """u64 length + JSON header (space padded so the data buffer is 8-byte aligned, as safetensors
    does) for tensors laid out in `specs` order, and each tensor's offset in the data buffer.
    Refuses what SafetensorsFile (and the library) would refuse to read back."""
    header, offsets, off = {}, {}, 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, s in specs.items():
        what = f"cannot write a safetensors header: tensor {name!r}"
        if not isinstance(name, str) or name == "__metadata__":
            raise CheckpointError(f"{what}: expected a string name other than '__metadata__'")
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise CheckpointError(f"{what}: the name is not valid Unicode (lone surrogate)") from None
        if s.dtype not in NUMPY_DTYPE:
            raise CheckpointError(f"{what} has dtype {s.dtype!r}, expected one of {', '.join(NUMPY_DTYPE)}")
        if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and 0 <= d < U64
                   for d in s.shape):
            raise CheckpointError(f"{what} has shape {list(s.shape)}, expected non-negative integers")
        header[name] = {"dtype": s.dtype, "shape": [int(d) for d in s.shape],
                        "data_offsets": [off, off + s.nbytes]}
        offsets[name] = off
        off += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets


def check_array(name: str, spec: TensorSpec, arr: np.ndarray, where: str) -> np.ndarray:
    want = NUMPY_DTYPE[spec.dtype]
    if arr.dtype != want or tuple(arr.shape) != spec.shape:
        raise CheckpointError(f"{where}: tensor '{name}' expected {spec.dtype} {list(spec.shape)} "
                              f"(numpy {np.dtype(want).name}), got {arr.dtype} {list(arr.shape)}")
    return np.ascontiguousarray(arr)


def write_safetensors(path, specs: dict[str, TensorSpec], chunks: Iterable[tuple[str, np.ndarray]],
                      metadata: dict | None = None) -> int:
    """Stream `chunks` ((name, row block) pairs in `specs` order; a tensor may arrive in several
    consecutive row blocks) into `path`. Returns the file size. Checks every byte is accounted for."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".partial")
    names = list(specs)
    written = {n: 0 for n in names}
    idx = 0
    with open(tmp, "wb") as f:
        f.write(header_bytes(specs, metadata or {"format": "pt"})[0])
        for name, block in chunks:
            while idx < len(names) and written[names[idx]] == specs[names[idx]].nbytes and names[idx] != name:
                idx += 1
            if idx >= len(names) or names[idx] != name:
                raise CheckpointError(f"{path}: tensor '{name}' arrived out of order or is not in the shard")
            spec = specs[name]
            block = np.ascontiguousarray(block)
            if block.dtype != NUMPY_DTYPE[spec.dtype] or tuple(block.shape[1:]) != spec.shape[1:]:
                raise CheckpointError(f"{path}: tensor '{name}' expected {spec.dtype} {list(spec.shape)}, "
                                      f"got a block {block.dtype} {list(block.shape)}")
            if written[name] + block.nbytes > spec.nbytes:
                raise CheckpointError(f"{path}: tensor '{name}' got more rows than its shape {list(spec.shape)}")
            f.write(block.tobytes())
            written[name] += block.nbytes
        missing = [n for n in names if written[n] != specs[n].nbytes]
        if missing:
            raise CheckpointError(f"{path}: tensors not fully written: {missing[:5]}")
    os.replace(tmp, path)
    return path.stat().st_size
