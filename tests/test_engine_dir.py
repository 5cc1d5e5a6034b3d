"""ddtree/engine_dir/: the layout's paths, config.json checked on write and on read (each required
field missing or of the wrong type is named with the file), the manifest's verification, and the
loader of a rank's tensors in its three conversions against the stored bits."""
import hashlib
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from ddtree import engine_dir as ed
from ddtree.engine_dir import EngineFormatError
from ddtree.model.safetensors_io import write_safetensors
from ddtree.model.tensors import TensorSpec

FIELDS = {"model": {"hidden_size": 8}, "drafter": {"block_size": 4}, "tp": 2, "experts": "tp", "archs": ["sm_120"],
          "budgets": [8, 16], "block_size": 4, "plan": {"tp": 2}, "weight_files": ["embed.safetensors"]}
WRONG = [("model", []), ("drafter", "drafter"), ("tp", 0), ("tp", -2), ("tp", "2"), ("tp", 2.0), ("tp", True),
         ("experts", "dp"), ("experts", None), ("archs", "sm_120"), ("archs", [""]), ("archs", ["sm_120", 90]),
         ("budgets", [8, 0]), ("budgets", [8.5]), ("block_size", None), ("plan", []),
         ("weight_files", "embed.safetensors"), ("weight_files", ["embed.safetensors", 3]), ("weight_files", [])]


def without(field: str) -> dict:
    return {k: v for k, v in FIELDS.items() if k != field}


def write_raw(root, d: dict):
    ed.config_path(root).write_text(json.dumps(d))


def test_layout_paths(tmp_path):
    assert ed.rank_name(3) == "rank3" and ed.rank_dir(tmp_path, 3) == tmp_path / "rank3"
    assert ed.config_path(tmp_path) == tmp_path / "config.json"
    assert ed.manifest_path(tmp_path) == tmp_path / "manifest.json"
    assert ed.plans_path(tmp_path) == tmp_path / "plans.json" and ed.plan_rel(1, "head") == "rank1/head.plan"
    assert ed.graphs_index_path(tmp_path) == tmp_path / "graphs" / "index.json"
    assert ed.graphs_rank_dir(tmp_path, 1) == tmp_path / "graphs" / "rank1"
    assert ed.graph_rel(1, "moe_layer") == "graphs/rank1/moe_layer.onnx"
    assert ed.kernels_dir(tmp_path, "sm_120") == tmp_path / ed.kernels_rel("sm_120") == tmp_path / "kernels" / "sm_120"
    assert ed.tokenizer_dir(tmp_path) == tmp_path / "tokenizer"


# ----------------------------------------------------------------------------------------------
# config.json

def test_config_round_trip(tmp_path):
    assert not ed.is_engine_dir(tmp_path)
    written = ed.write_engine_config(tmp_path, {**FIELDS, "kernels": {}})
    assert list(written)[0] == "format" and written["format"] == ed.ENGINE_FORMAT
    assert ed.read_engine_config(tmp_path) == written == json.loads(ed.config_path(tmp_path).read_text())
    assert ed.is_engine_dir(tmp_path)


@pytest.mark.parametrize("field", list(ed.REQUIRED))
def test_missing_field_is_refused_on_write_and_on_read(tmp_path, field):
    path = ed.config_path(tmp_path)
    with pytest.raises(EngineFormatError, match=re.escape(f"{path}: missing required field '{field}'")):
        ed.write_engine_config(tmp_path, without(field))
    assert not path.exists()
    write_raw(tmp_path, {"format": ed.ENGINE_FORMAT, **without(field)})
    with pytest.raises(EngineFormatError, match=re.escape(f"{path}: missing required field '{field}'")):
        ed.read_engine_config(tmp_path)


@pytest.mark.parametrize("field,value", WRONG)
def test_wrong_type_is_refused_on_write_and_on_read(tmp_path, field, value):
    path = ed.config_path(tmp_path)
    message = f"{path}: field '{field}' must be {ed.REQUIRED[field][0]}"
    with pytest.raises(EngineFormatError, match=re.escape(message)):
        ed.write_engine_config(tmp_path, {**FIELDS, field: value})
    assert not path.exists()
    write_raw(tmp_path, {"format": ed.ENGINE_FORMAT, **FIELDS, field: value})
    with pytest.raises(EngineFormatError, match=re.escape(message)):
        ed.read_engine_config(tmp_path)


def test_reader_names_the_format_and_a_broken_file(tmp_path):
    path = ed.config_path(tmp_path)
    with pytest.raises(EngineFormatError, match=re.escape(f"{path}: missing or not a JSON object")):
        ed.read_engine_config(tmp_path)
    path.write_text("{not json")
    with pytest.raises(EngineFormatError, match="missing or not a JSON object"):
        ed.read_engine_config(tmp_path)
    assert not ed.is_engine_dir(tmp_path)
    write_raw(tmp_path, {**FIELDS, "format": "ddtree-engine/2"})
    assert ed.is_engine_dir(tmp_path)                          # the family, though this runtime cannot read it
    with pytest.raises(EngineFormatError, match="format 'ddtree-engine/2' is not supported"):
        ed.read_engine_config(tmp_path)
    with pytest.raises(EngineFormatError, match="format 'other/1' is not supported"):
        ed.write_engine_config(tmp_path, {**FIELDS, "format": "other/1"})


# ----------------------------------------------------------------------------------------------
# manifest.json

def test_manifest_names_every_changed_file(tmp_path):
    ed.write_engine_config(tmp_path, FIELDS)
    ed.rank_dir(tmp_path, 0).mkdir()
    (ed.rank_dir(tmp_path, 0) / "a.bin").write_bytes(bytes(range(256)) * 5000)      # > one 1 MiB read
    (ed.rank_dir(tmp_path, 0) / "b.bin").write_bytes(b"bbbb")
    manifest = ed.write_manifest(tmp_path)
    assert manifest["format"] == ed.ENGINE_FORMAT
    assert list(manifest["files"]) == ["config.json", "rank0/a.bin", "rank0/b.bin"]
    assert manifest["files"]["rank0/b.bin"] == {"size": 4, "sha256": ed.sha256_file(ed.rank_dir(tmp_path, 0) / "b.bin")}
    assert json.loads(ed.manifest_path(tmp_path).read_text()) == manifest
    assert ed.verify_manifest(tmp_path) == []

    a = ed.rank_dir(tmp_path, 0) / "a.bin"
    data = bytearray(a.read_bytes())
    data[-1] ^= 0x01                                           # in the last of the 1 MiB reads
    a.write_bytes(bytes(data))
    (ed.rank_dir(tmp_path, 0) / "b.bin").write_bytes(b"bbbbb")
    (ed.rank_dir(tmp_path, 0) / "c.bin").write_bytes(b"c")
    ed.config_path(tmp_path).unlink()
    problems = ed.verify_manifest(tmp_path)
    assert len(problems) == 4
    assert problems[0] == "config.json: listed in manifest.json but missing"
    assert problems[1].startswith("rank0/a.bin: sha256 mismatch")
    assert problems[2] == "rank0/b.bin: size 5 bytes, the manifest says 4"
    assert problems[3] == "rank0/c.bin: present but not listed in manifest.json"


def test_manifest_missing_or_invalid(tmp_path):
    with pytest.raises(EngineFormatError, match=re.escape(f"{ed.manifest_path(tmp_path)}: missing")):
        ed.verify_manifest(tmp_path)
    for text in ("[1, 2]", '{"format": "ddtree-engine/1"}', '{"files": []}', "{"):
        ed.manifest_path(tmp_path).write_text(text)
        with pytest.raises(EngineFormatError, match=re.escape(f"{ed.manifest_path(tmp_path)}: not a valid manifest")):
            ed.verify_manifest(tmp_path)


GOOD_ENTRY = {"size": 4, "sha256": "ab" * 32}
BAD_MANIFESTS = [                      # (manifest, what the message says after "not a valid manifest: ")
    ({"format": "ddtree-engine/1", "files": {"a.bin": 4}}, "entry 'a.bin' must be an object"),
    ({"format": "ddtree-engine/1", "files": {"a.bin": [4, "ab"]}}, "entry 'a.bin' must be an object"),
    ({"format": "ddtree-engine/1", "files": {"a.bin": None}}, "entry 'a.bin' must be an object"),
    ({"format": "ddtree-engine/1", "files": {"a.bin": {"size": 4}}}, "entry 'a.bin' must be an object"),
    ({"format": "ddtree-engine/1", "files": {"a.bin": {**GOOD_ENTRY, "size": -1}}}, "got {'size': -1"),
    ({"format": "ddtree-engine/1", "files": {"a.bin": {**GOOD_ENTRY, "size": "4"}}}, "got {'size': '4'"),
    ({"format": "ddtree-engine/1", "files": {"a.bin": {**GOOD_ENTRY, "size": True}}}, "got {'size': True"),
    ({"format": "ddtree-engine/1", "files": {"a.bin": {**GOOD_ENTRY, "sha256": "AB" * 32}}}, "64 lowercase hex"),
    ({"format": "ddtree-engine/1", "files": {"a.bin": {**GOOD_ENTRY, "sha256": "ab"}}}, "64 lowercase hex"),
    ({"format": "ddtree-engine/1", "files": {"a.bin": {**GOOD_ENTRY, "extra": 1}}}, "entry 'a.bin' must be"),
    ({"format": "ddtree-engine/1", "files": {"../a.bin": GOOD_ENTRY}}, "entry '../a.bin' is not a relative path"),
    ({"format": "ddtree-engine/1", "files": {"/etc/passwd": GOOD_ENTRY}}, "entry '/etc/passwd' is not a relative"),
    ({"format": "ddtree-engine/1", "files": {"rank0//a.bin": GOOD_ENTRY}}, "entry 'rank0//a.bin' is not"),
    ({"format": "ddtree-engine/1", "files": {"manifest.json": GOOD_ENTRY}}, "entry 'manifest.json' is not"),
    ({"format": "ddtree-engine/1", "files": "a.bin"}, "field 'files' must be an object"),
    ({"format": "ddtree-engine/2", "files": {}}, "field 'format' is 'ddtree-engine/2', expected 'ddtree-engine/1'"),
    ({"format": "ddtree-engine/1", "files": {}, "extra": 1}, "unknown field 'extra'"),
    ({"format": "ddtree-engine/1", "files": {"a.bin": GOOD_ENTRY}, "files_sha256": "0" * 64},
     "its file table does not match its checksum files_sha256"),
]


@pytest.mark.parametrize("manifest,says", BAD_MANIFESTS)
def test_manifest_structure_is_named(tmp_path, manifest, says):
    ed.manifest_path(tmp_path).write_text(json.dumps(manifest))
    with pytest.raises(EngineFormatError) as e:
        ed.read_manifest(tmp_path)
    assert str(e.value).startswith(f"{ed.manifest_path(tmp_path)}: not a valid manifest: ")
    assert says in str(e.value)


def test_manifest_checksums_its_own_file_table(tmp_path):
    """Written with files_sha256; one changed digit of any entry is named as the manifest's damage; a manifest
    without files_sha256 (engines built before it) is still read."""
    (tmp_path / "a.bin").write_bytes(b"aaaa")
    written = ed.write_manifest(tmp_path)
    want = hashlib.sha256(json.dumps(written["files"], sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert written["files_sha256"] == want == ed.files_checksum(written["files"])
    assert ed.read_manifest(tmp_path) == written
    text = ed.manifest_path(tmp_path).read_text()
    ed.manifest_path(tmp_path).write_text(text.replace('"size": 4', '"size": 5'))
    with pytest.raises(EngineFormatError, match="does not match its checksum files_sha256"):
        ed.read_manifest(tmp_path)
    old = {k: v for k, v in written.items() if k != "files_sha256"}
    ed.manifest_path(tmp_path).write_text(json.dumps(old))
    assert ed.read_manifest(tmp_path) == old


def test_an_engine_is_known_by_its_manifest_and_a_checkpoint_is_not_one(tmp_path):
    """A damaged engine config.json still makes an engine dir (its damage is named by the load); a checkpoint
    directory given as an engine is said to be one."""
    ed.config_path(tmp_path).write_text("{damaged")
    assert not ed.is_engine_dir(tmp_path)
    ed.manifest_path(tmp_path).write_text("{}")
    assert ed.is_engine_dir(tmp_path)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "kimi_k2", "hidden_size": 7168}))
    for fn in (ed.check_engine, ed.engine_problems):
        with pytest.raises(EngineFormatError, match=re.escape(f"{ckpt}: not an engine directory: it has no "
                                                              "manifest.json and its config.json has no engine "
                                                              "format (model_type 'kimi_k2')")):
            fn(ckpt)


# ----------------------------------------------------------------------------------------------
# one rank's tensors

# bf16 bits and the values they hold: 1, 1.5, -3, 3.140625, 0, -0, the smallest subnormal, inf
BITS = np.array([[0x3F80, 0x3FC0, 0xC040, 0x4049], [0x0000, 0x8000, 0x0001, 0x7F80]], np.uint16)
VALUES = np.array([[1.0, 1.5, -3.0, 3.140625], [0.0, -0.0, 2.0 ** -133, np.inf]])
BIAS = np.array([0.1, -2.5, 3e-8], np.float32)
WORDS = np.array([[0x12345678, -1], [7, -0x7FFFFFFF]], np.int32)
SCALES = np.array([[0x3C00], [0xBF80]], np.uint16)
EXPERTS = "model.layers.1.mlp.experts."


@pytest.fixture
def rank_files(tmp_path):
    """rank1/{a,b}.safetensors holding BF16, F32 and the routed experts' I32 words and BF16 scales."""
    tensors = {"a.safetensors": {"model.embed.weight": ("BF16", BITS), "model.router.bias": ("F32", BIAS)},
               "b.safetensors": {EXPERTS + "down.words": ("I32", WORDS), EXPERTS + "down.scales": ("BF16", SCALES)}}
    ed.rank_dir(tmp_path, 1).mkdir()
    for fname, named in tensors.items():
        specs = {n: TensorSpec(dt, a.shape) for n, (dt, a) in named.items()}
        write_safetensors(ed.rank_dir(tmp_path, 1) / fname, specs, [(n, a) for n, (_, a) in named.items()])
    return tmp_path, list(tensors)


def test_load_as_stored(rank_files):
    root, files = rank_files
    t = ed.load_rank_tensors(root, 1, files, convert=ed.STORED)
    assert list(t) == ["model.embed.weight", "model.router.bias", EXPERTS + "down.words", EXPERTS + "down.scales"]
    for name, want in zip(t, (BITS, BIAS, WORDS, SCALES)):
        assert t[name].dtype == want.dtype and np.array_equal(t[name], want), name


def test_load_as_bfloat16_for_the_graphs(rank_files):
    import ml_dtypes
    root, files = rank_files
    t = ed.load_rank_tensors(root, 1, files, convert=ed.BFLOAT16)
    for name, bits in (("model.embed.weight", BITS), (EXPERTS + "down.scales", SCALES)):
        assert t[name].dtype == ml_dtypes.bfloat16 and np.array_equal(t[name].view(np.uint16), bits), name
    assert np.array_equal(t["model.embed.weight"].astype(np.float64), VALUES)
    assert t["model.router.bias"].dtype == np.float32 and np.array_equal(t["model.router.bias"], BIAS)
    assert t[EXPERTS + "down.words"].dtype == np.int32 and np.array_equal(t[EXPERTS + "down.words"], WORDS)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, "float64"])
def test_load_dense_as_float_experts_as_stored(rank_files, dtype):
    root, files = rank_files
    t = ed.load_rank_tensors(root, 1, files, convert=dtype)
    dense = t["model.embed.weight"]
    assert dense.dtype == np.dtype(dtype) and np.array_equal(dense, VALUES)                 # exact
    assert np.array_equal(np.signbit(dense), np.signbit(VALUES))                            # -0 stays -0
    assert t["model.router.bias"].dtype == np.dtype(dtype)
    assert np.array_equal(t["model.router.bias"], BIAS.astype(dtype))
    assert t[EXPERTS + "down.words"].dtype == np.int32 and np.array_equal(t[EXPERTS + "down.words"], WORDS)
    assert t[EXPERTS + "down.scales"].dtype == np.uint16 and np.array_equal(t[EXPERTS + "down.scales"], SCALES)


def test_load_errors(rank_files):
    root, files = rank_files
    for bad in ("int32", np.int32, "fp8", None):
        message = f"convert={bad!r}: expected 'stored', 'bfloat16' or a numpy float dtype"
        with pytest.raises(ValueError, match=re.escape(message)):
            ed.load_rank_tensors(root, 1, files, convert=bad)
    with pytest.raises(EngineFormatError, match="rank1/gone.safetensors: weight file listed in config.json is missing"):
        ed.load_rank_tensors(root, 1, [*files, "gone.safetensors"])
    with pytest.raises(EngineFormatError, match="rank0/a.safetensors: weight file listed"):
        ed.load_rank_tensors(root, 0, files)


def test_load_hashes_each_file_as_it_reads_it(rank_files):
    """digests (check_engine's): the tensors are the same as read without them, and a file whose sha256
    differs from its entry is named, as is one the digests do not list."""
    root, files = rank_files
    digests = {f"rank1/{f}": {"size": (ed.rank_dir(root, 1) / f).stat().st_size,
                              "sha256": hashlib.sha256((ed.rank_dir(root, 1) / f).read_bytes()).hexdigest()}
               for f in files}
    for convert in (ed.STORED, np.float64):
        plain, hashed = (ed.load_rank_tensors(root, 1, files, convert=convert, digests=d) for d in (None, digests))
        assert list(plain) == list(hashed)
        for name in plain:
            assert plain[name].dtype == hashed[name].dtype and np.array_equal(plain[name], hashed[name]), name
    path = ed.rank_dir(root, 1) / files[1]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01                                             # the last byte of the last tensor
    path.write_bytes(bytes(data))
    with pytest.raises(EngineFormatError, match=re.escape(f"{root}/rank1/{files[1]}: sha256 mismatch")):
        ed.load_rank_tensors(root, 1, files, digests=digests)
    assert ed.load_rank_tensors(root, 1, files)                 # unverified: read as it is
    with pytest.raises(EngineFormatError, match=f"{files[0]}: weight file not listed in manifest.json"):
        ed.load_rank_tensors(root, 1, files, digests={})


def test_without_ml_dtypes_bf16_is_refused_by_name(rank_files):
    """ml_dtypes is a dependency of ddtree (the safetensors library's numpy reader holds BF16 with it); an install
    without it reads float tensors but refuses a BF16 one naming the package, never a bare ImportError."""
    root, files = rank_files
    code = ("import sys; sys.modules['ml_dtypes'] = None\n"
            "from ddtree import engine_dir as ed\n"
            "from ddtree.model.safetensors_io import CheckpointError\n"
            f"root, files = {str(root)!r}, {files!r}\n"
            "try:\n    ed.load_rank_tensors(root, 1, files)\n"
            "except CheckpointError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "is BF16" in r.stdout and "ml_dtypes (a dependency of ddtree: pip install ml-dtypes)" in r.stdout
