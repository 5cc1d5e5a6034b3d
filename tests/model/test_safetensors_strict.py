"""SafetensorsFile refuses whatever the `safetensors` library refuses, tested differentially.

A few small valid files (our writer: BF16/F32/I32 and a zero-size tensor; the library's save_file:
F32/I32/U8/I64 scalar) are mutated a few hundred ways, seeded: byte flips inside the JSON, edited
offsets (overlap, gap, swap, past the end, a re-tiling in another order), shapes, dtypes, the header
length field, truncations, trailing bytes, metadata and JSON-level edits. For each mutant:
  - the library refuses it (safe_open raises, or reading a tensor does) -> we raise CheckpointError
    naming the file;
  - the library reads it -> we read the same names, dtypes, shapes and bytes, or refuse it for one
    of the reasons in STRICTER (computed here independently), with that reason in our message.
"""
import json
import random
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from ddtree.data import tiny_model_dirs
from ddtree.model.safetensors_io import CheckpointError, SafetensorsFile, write_safetensors
from ddtree.model.tensors import TensorSpec
from tests.cli.bad_input import refuses

try:                                   # registers bfloat16 with numpy, so the library's numpy reader holds BF16
    import ml_dtypes  # noqa: F401
    LIB_READS_BF16 = True
except ImportError:
    LIB_READS_BF16 = False
    from safetensors import deserialize

# the format's dtypes (safetensors 0.8 docs) and the numpy itemsize of the ones we hold
FORMAT_DTYPES = ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16", "I32",
                 "U32", "F32", "C64", "F64", "I64", "U64", "F4", "F6_E2M3", "F6_E3M2"]
OUR_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4,
                "F32": 4, "F64": 8, "I64": 8, "U64": 8}

# Files the library reads and we refuse, on purpose:
STRICTER = {
    # the library keeps the last of two equal keys (two tensors of one name: it silently drops one)
    "duplicate key": "an ambiguous header: which of the two is the tensor?",
    # fp8 / fp6 / fp4 / complex: numpy has no such dtype; the checkpoints we read never hold them
    "unsupported dtype": "not a corrupt file, a dtype this reader cannot hold",
    # a zero-size tensor with a dimension past numpy's limit: the library's numpy reader fails on it
    # too (ValueError), but only when it is read, and not at all through its raw-bytes fallback
    "too large for a numpy array": "numpy cannot allocate the shape",
}


# ------------------------------------------------------------------------------------------------
# the two readers
def library_read(path: Path):
    """{name: (dtype, shape, bytes)} and metadata as the library reads them, or the reason it refuses."""
    try:
        f = safe_open(str(path), framework="numpy")
    except Exception as e:          # noqa: BLE001 -- whatever the library raises is its refusal
        return f"open: {type(e).__name__}: {e}", None
    with f:
        out = {}
        raw = None
        for name in f.keys():
            dtype = f.get_slice(name).get_dtype()
            if dtype == "BF16" and not LIB_READS_BF16:
                raw = raw or {n: t for n, t in deserialize(path.read_bytes())}
                t = raw[name]
                out[name] = (dtype, tuple(t["shape"]), bytes(t["data"]))
                continue
            try:
                a = f.get_tensor(name)
            except Exception as e:  # noqa: BLE001 -- numpy refusing the shape or dtype
                return f"read {name}: {type(e).__name__}: {e}", None
            out[name] = (dtype, a.shape, a.tobytes())
        return out, f.metadata() or {}


def our_read(path: Path):
    """The same through SafetensorsFile, or the CheckpointError message (anything else propagates)."""
    try:
        f = SafetensorsFile(path)
        try:
            return {n: (s.dtype, s.shape, f.read(n).tobytes()) for n, s in f.entries.items()}, f.metadata
        finally:
            f.close()
    except CheckpointError as e:
        return str(e), None


def stricter_reason(blob: bytes):
    """The STRICTER key that lets us refuse a file the library reads, judged from the header alone."""
    n = struct.unpack("<Q", blob[:8])[0]
    dup = []

    def pairs(items):
        keys = [k for k, _ in items]
        dup.extend(k for k in set(keys) if keys.count(k) > 1)
        return dict(items)
    header = json.loads(blob[8:8 + n], object_pairs_hook=pairs)
    if dup:
        return "duplicate key"
    header.pop("__metadata__", None)
    if any(e["dtype"] not in OUR_ITEMSIZE for e in header.values()):
        return "unsupported dtype"
    for e in header.values():
        size = OUR_ITEMSIZE[e["dtype"]]
        for d in e["shape"]:
            size *= max(d, 1)
        if size >= 2 ** 63:
            return "too large for a numpy array"
    return None


# ------------------------------------------------------------------------------------------------
# valid files and their mutants
def base_files(tmp: Path) -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    specs = {"w": TensorSpec("BF16", (3, 4)), "b": TensorSpec("F32", (5,)), "idx": TensorSpec("I32", (2, 3)),
             "z": TensorSpec("F32", (0, 7))}
    blocks = {"w": rng.integers(0, 1 << 16, (3, 4), dtype=np.uint16),
              "b": rng.standard_normal(5).astype(np.float32), "idx": rng.integers(-9, 9, (2, 3), dtype=np.int32)}
    write_safetensors(tmp / "ours.safetensors", specs, [(n, blocks[n]) for n in ("w", "b", "idx")])
    save_file({"a": rng.standard_normal((2, 2)).astype(np.float32), "i": np.arange(3, dtype=np.int32),
               "u": np.arange(5, dtype=np.uint8), "s": np.array(7, dtype=np.int64)},
              str(tmp / "lib.safetensors"), metadata={"k": "v"})
    return {p: (tmp / f"{p}.safetensors").read_bytes() for p in ("ours", "lib")}


def split(blob: bytes):
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def pack(header, data: bytes, pad: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    raw += pad
    return struct.pack("<Q", len(raw)) + raw + data


def mutants(base: bytes, rng: random.Random):
    """(family, label, bytes) for one valid file."""
    header, data = split(base)
    n = len(base) - len(data) - 8
    names = [k for k in header if k != "__metadata__"]
    out = []

    def edit(family, label, fn):
        h = json.loads(json.dumps(header))
        fn(h)
        out.append((family, label, pack(h, data)))

    # 1. byte flips inside the JSON text (digits and JSON punctuation make the mutant parse more often)
    alphabet = b"0123456789" * 3 + b'{}[],:" -.eE+_FIUB' + bytes(range(256))
    for i in range(50):
        blob = bytearray(base)
        for _ in range(rng.choice((1, 1, 2, 3))):
            blob[8 + rng.randrange(n)] = rng.choice(alphabet)
        out.append(("flip", f"flip {i}", bytes(blob)))
    digits = [i for i in range(8, 8 + n) if chr(base[i]).isdigit()]
    for i in range(30):                # a digit for a digit: still JSON, other offsets or shapes
        blob = bytearray(base)
        blob[rng.choice(digits)] = rng.choice(b"0123456789")
        out.append(("flip", f"digit flip {i}", bytes(blob)))

    # 2. offsets
    def offsets(name, fn):
        return lambda h: h[name].__setitem__("data_offsets", fn(*h[name]["data_offsets"]))
    for _ in range(6):
        t, k = rng.choice(names), rng.choice((1, 2, 4, 8, 12))
        edit("offsets", f"{t} shifted -{k}", offsets(t, lambda b, e: [b - k, e - k]))
        edit("offsets", f"{t} shifted +{k}", offsets(t, lambda b, e: [b + k, e + k]))
        edit("offsets", f"{t} end +{k}", offsets(t, lambda b, e: [b, e + k]))
        edit("offsets", f"{t} begin +{k}", offsets(t, lambda b, e: [b + k, e]))
    for _ in range(4):
        t, u = rng.sample(names, 2)
        edit("offsets", f"swap {t} {u}", lambda h: (h[t].__setitem__("data_offsets", h[u]["data_offsets"]),
                                                   h[u].__setitem__("data_offsets", header[t]["data_offsets"])))
        edit("offsets", f"{t} on {u}", lambda h: h[t].__setitem__("data_offsets", h[u]["data_offsets"]))
    for t in names:
        edit("offsets", f"{t} reversed", offsets(t, lambda b, e: [e, b]))
        edit("offsets", f"{t} past end", offsets(t, lambda b, e: [b, len(data) + 8]))
        edit("offsets", f"{t} at end", offsets(t, lambda b, e: [len(data), len(data)]))
    for i in range(3):                 # tile the same buffer in another order: valid, other bytes per tensor
        order = rng.sample(names, len(names))

        def retile(h, order=order):
            off = 0
            for t in order:
                b, e = h[t]["data_offsets"]
                h[t]["data_offsets"] = [off, off + e - b]
                off += e - b
        edit("offsets", f"retiled {i}", retile)

    # 3. shapes
    def shape(name, fn):
        return lambda h: h[name].__setitem__("shape", fn(h[name]["shape"]))
    for t in names:
        edit("shape", f"{t} dim+1", shape(t, lambda s: [s[0] + 1, *s[1:]] if s else [1]))
        edit("shape", f"{t} dim-1", shape(t, lambda s: [s[0] - 1, *s[1:]] if s else [0]))
        edit("shape", f"{t} append 1", shape(t, lambda s: [*s, 1]))
        edit("shape", f"{t} flattened", shape(t, lambda s: [int(np.prod(s))]))
        edit("shape", f"{t} zero dim", shape(t, lambda s: [*s, 0]))
        edit("shape", f"{t} scalar", shape(t, lambda s: []))
    for bad in (-1, 2.0, "4", True, None, 2 ** 63, 2 ** 64, [2]):
        t = rng.choice(names)
        edit("shape", f"{t} dim {bad!r}", shape(t, lambda s, bad=bad: [bad, *s[1:]]))
    for big in ([0, 2 ** 63], [2 ** 62, 0, 4], [2 ** 40, 2 ** 40, 0], [2 ** 32, 2 ** 32, 2 ** 1]):
        t = rng.choice(names)
        edit("shape", f"{t} shape {big}", shape(t, lambda s, big=big: big))
    edit("shape", "shape not a list", shape(names[0], lambda s: {"0": 1}))

    # 4. dtypes
    for t in names:
        for d in rng.sample(FORMAT_DTYPES, 4) + [rng.choice(("f32", "BF17", "", 16, None, ["F32"]))]:
            edit("dtype", f"{t} dtype {d!r}", lambda h, t=t, d=d: h[t].__setitem__("dtype", d))

    for t in names:                    # a dtype of the same width that numpy cannot hold: valid, we refuse
        for d in {"U8": ["F8_E4M3", "F8_E5M2"], "I64": ["C64"]}.get(header[t]["dtype"], []):
            edit("dtype", f"{t} dtype {d}", lambda h, t=t, d=d: h[t].__setitem__("dtype", d))

    # 5. the header length field
    for m in (n - 8, n - 1, n + 1, n + 2, n + 8, 0, 1, len(base) - 8, len(base) - 7, 100_000_000,
              100_000_001, 2 ** 63, 2 ** 64 - 1):
        out.append(("length", f"n={m}", struct.pack("<Q", m) + base[8:]))

    # 6. truncations and 7. trailing bytes / padding
    for cut in {0, 5, 8, 9, n + 7, n + 8, len(base) - 1} | {rng.randrange(len(base)) for _ in range(5)}:
        out.append(("truncate", f"cut at {cut}", base[:cut]))
    raw = base[8:8 + n]
    for k in (1, 3, 8, 16):
        out.append(("trailing", f"+{k} bytes", base + bytes(rng.randrange(256) for _ in range(k))))
    for pad in (b" " * 8, b" \n\t\r", b"\x00" * 8, b" x"):
        out.append(("trailing", f"header padded {pad!r}", pack(raw, data, pad)))
    out.append(("trailing", "header led by spaces", pack(b"   " + raw, data)))

    # 8. metadata
    for meta in (None, {}, {"k": 1}, {"k": None}, [], "x", {"k": ["a"]}, {"k": {"a": "b"}}, {"k": "v", "\u00e9": "w"}):
        edit("metadata", f"metadata {meta!r}", lambda h, meta=meta: h.__setitem__("__metadata__", meta))

    # 9. JSON-level edits, made on the text
    text = raw.decode().rstrip()
    t = rng.choice(names)
    entry = json.dumps(header[t], separators=(",", ":"))
    body = entry[1:-1]
    b0 = header[t]["data_offsets"][0]
    assert entry in text and '"__metadata__":{' in text       # the edits below find what they edit
    for label, new in [
        ("tensor twice", text[:-1] + f',"{t}":{entry}}}'),
        ("metadata key twice", text.replace('"__metadata__":{', '"__metadata__":{"k":"a","k":"b",', 1)),
        ("extra field twice", text.replace(entry, "{" + body + ',"note":1,"note":2}')),
        ("field twice", text.replace(entry, "{" + body + ',"dtype":"' + header[t]["dtype"] + '"}')),
        ("extra field", text.replace(entry, "{" + body + ',"note":[1,"x",{"y":null}]}')),
        ("extra NaN", text.replace(entry, "{" + body + ',"note":NaN}')),
        ("extra 1e999", text.replace(entry, "{" + body + ',"note":1e999}')),
        ("extra lone surrogate", text.replace(entry, "{" + body + ',"note":"\\ud800"}')),
        ("extra deep", text.replace(entry, "{" + body + ',"note":' + "[" * 130 + "]" * 130 + "}")),
        ("extra deep but not too deep", text.replace(entry, "{" + body + ',"note":' + "[" * 120 + "]" * 120 + "}")),
        ("begin negated", text.replace(entry, entry.replace('"data_offsets":[', '"data_offsets":[-', 1))),
        ("begin as a float", text.replace(entry, entry.replace(f'"data_offsets":[{b0},', f'"data_offsets":[{b0}e0,'))),
        ("entry a list", text.replace(entry, "[" + body + "]")),
        ("top-level list", "[" + text + "]"),
        ("not UTF-8", text.replace(f'"{t}"', f'"{t}\udcff"', 1)),
    ]:
        blob = new.encode("utf-8", "surrogateescape")
        out.append(("json", label, pack(blob, data)))
    return out


# ------------------------------------------------------------------------------------------------
def test_we_refuse_what_the_library_refuses(tmp_path):
    rng = random.Random(18)
    cases = [(src, *m) for src, blob in base_files(tmp_path).items() for m in mutants(blob, rng)]
    assert len(cases) > 400
    path = tmp_path / "m.safetensors"
    tally = {"both read": 0, "both refuse": 0, "we are stricter": 0}
    families: dict[str, set[str]] = {}
    stricter = set()
    for src, family, label, blob in cases:
        path.write_bytes(blob)
        lib, lib_meta = library_read(path)
        ours, our_meta = our_read(path)
        what = f"{src} / {family} / {label}"
        if isinstance(lib, str):                       # the library refuses: so do we, naming the file
            assert isinstance(ours, str), f"{what}: the library refuses ({lib}), we read it"
            assert ours.startswith(f"{path}: "), f"{what}: {ours}"
            tally["both refuse"] += 1
            families.setdefault(family, set()).add("refused")
        elif isinstance(ours, str):                    # we refuse what it reads: only as STRICTER says
            reason = stricter_reason(blob)
            assert reason is not None, f"{what}: the library reads it, we refuse: {ours}"
            assert reason in ours and ours.startswith(f"{path}: "), f"{what}: {reason!r} not in {ours}"
            tally["we are stricter"] += 1
            stricter.add(reason)
        else:                                          # both read it: the same tensors, bit for bit
            assert ours == lib, f"{what}: we read other tensors than the library"
            assert our_meta == lib_meta, f"{what}: metadata {our_meta} vs {lib_meta}"
            tally["both read"] += 1
            families.setdefault(family, set()).add("read")
    # the mutants exercise both sides of the line, in the families where it is subtle
    assert tally["both read"] >= 40 and tally["both refuse"] >= 300 and tally["we are stricter"] >= 5, tally
    assert stricter >= {"duplicate key", "unsupported dtype"}, stricter
    for family in ("flip", "offsets", "shape", "dtype", "trailing", "metadata", "json"):
        assert families[family] == {"read", "refused"}, (family, families[family])


def _file(tmp_path, header: dict | bytes, data: bytes) -> Path:
    path = tmp_path / "t.safetensors"
    path.write_bytes(pack(header, data))
    return path


def T(dtype, shape, b, e):
    return {"dtype": dtype, "shape": shape, "data_offsets": [b, e]}


# each refused by the library too (checked), our message naming the file, the tensor and what was expected
NAMED = [
    ("overlap", {"a": T("F32", [2], 0, 8), "b": T("F32", [2], 4, 12), "c": T("F32", [1], 12, 16)}, 16,
     ["tensor 'b' data_offsets [4, 12) overlap tensor 'a' [0, 8)", "tile"]),
    ("gap", {"a": T("F32", [1], 0, 4), "b": T("F32", [1], 8, 12)}, 12,
     ["tensor 'b' data_offsets [8, 12) leave a gap of 4 bytes after tensor 'a'"]),
    ("gap at start", {"a": T("F32", [1], 4, 8)}, 8, ["tensor 'a'", "gap of 4 bytes at the start"]),
    ("past end", {"a": T("F32", [4], 0, 16)}, 12, ["truncated file: tensor 'a' ends at byte", "file has"]),
    ("trailing", {"a": T("F32", [1], 0, 4)}, 6, ["2 bytes of trailing data", "tensor 'a'"]),
    ("begin > end", {"a": T("F32", [0], 8, 4)}, 8, ["tensor 'a' data_offsets [8, 4): begin is past end"]),
    ("size", {"a": T("BF16", [2, 3], 0, 8)}, 8, ["tensor 'a' data_offsets [0, 8) hold 8 bytes, expected 12",
                                                 "BF16 [2, 3]"]),
    ("dtype", {"a": T("FP32", [1], 0, 4)}, 4, ["tensor 'a' has dtype 'FP32', expected one of", "BF16"]),
    ("negative dim", {"a": T("F32", [-1], 0, 4)}, 4, ["tensor 'a' has shape [-1]", "0..2^64-1"]),
    ("missing field", {"a": {"dtype": "F32", "shape": [1]}}, 4, ["tensor 'a' lacks data_offsets"]),
    ("metadata value", {"__metadata__": {"format": 1}}, 0, ["__metadata__['format'] is 1, expected a string"]),
    ("not an object", b"[1, 2]", 0, ["a JSON list, expected an object"]),
    ("not UTF-8", b'{"\xff": 1}', 0, ["not UTF-8"]),
    ("duplicate __metadata__", b'{"__metadata__": {}, "__metadata__": {}}', 0,
     ["duplicate key '__metadata__'"]),
]


@pytest.mark.parametrize("header, data_len, fragments", [c[1:] for c in NAMED], ids=[c[0] for c in NAMED])
def test_refusals_are_named(tmp_path, header, data_len, fragments):
    path = _file(tmp_path, header, bytes(data_len))
    assert isinstance(library_read(path)[0], str), "the library reads this file: not a refusal case"
    with pytest.raises(CheckpointError) as e:
        SafetensorsFile(path)
    assert str(e.value).startswith(f"{path}: ")
    for f in fragments:
        assert f in str(e.value), (f, str(e.value))


def test_header_length_past_the_file(tmp_path):
    path = tmp_path / "t.safetensors"
    path.write_bytes(struct.pack("<Q", 100) + b"{}")
    with pytest.raises(CheckpointError, match=r"t.safetensors: corrupt safetensors header \(declares 100 header "
                                              r"bytes, file has 10\)"):
        SafetensorsFile(path)


def test_writer_refuses_what_the_reader_would(tmp_path):
    for specs, fragment in [({"__metadata__": TensorSpec("F32", (1,))}, "other than '__metadata__'"),
                            ({"a": TensorSpec("F8_E4M3", (1,))}, "has dtype 'F8_E4M3'"),
                            ({"a": TensorSpec("F32", (-1, 2))}, "has shape [-1, 2]")]:
        with pytest.raises(CheckpointError, match=r"cannot write a safetensors header: tensor .*" + fragment.replace(
                "[", r"\[").replace("]", r"\]")):
            write_safetensors(tmp_path / "w.safetensors", specs, [])
    assert not (tmp_path / "w.safetensors").exists()


def test_cli_refuses_a_shard_with_overlapping_offsets(tmp_path):
    """ddtree run on a checkpoint one of whose shards has two tensors sharing bytes (each of the
    right size, all in bounds: the old reader read wrong weights from it)."""
    target, drafter = (shutil.copytree(d, tmp_path / d.name) for d in tiny_model_dirs())
    shard = sorted(target.glob("*.safetensors"))[-1]
    header, data = split(shard.read_bytes())
    first, second = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])[:2]
    b, e = header[second]["data_offsets"]
    header[second]["data_offsets"] = [b - 2, e - 2]            # one bf16 element shared with `first`
    shard.write_bytes(pack(header, data, b" " * 8))
    assert isinstance(library_read(shard)[0], str)             # the library refuses the shard
    refuses(["run", "--model", str(target), "--drafter", str(drafter), "hi", "--max-new-tokens", "2"],
            "CheckpointError", str(shard), f"tensor '{second}'", f"overlap tensor '{first}'")
