"""An engine directory is checked before the first token (ddtree/engine_dir/ check_engine).

One tiny tp 2 engine is built per module (kernels, graphs and a tokenizer file, so that every kind of
engine file is there); each case copies it, damages one file the way bit rot or a hand edit would, and runs
`ddtree run` as a user does (a subprocess): the refusal names the damaged file, or the config field and its
value. --skip-verify skips the hashes only: a flipped weight byte then runs, a truncated file still stops.
"""
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from ddtree import engine_dir as ed
from ddtree.builder.build import build_engine
from ddtree.builder.plan import make_plan
from ddtree.model.config import DrafterConfig, KimiConfig
from ddtree.model.synthetic import synth
from tests.cli.bad_input import ddtree, refuses

RUN = ["--max-new-tokens", "2"]
WEIGHT = "rank1/layer-002.safetensors"          # a MoE layer of rank 1 (the last rank read)
TOKENIZER_FILE = "tokenizer/generation_config.json"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(engine dir, checkpoint target dir): tiny, tp 2, sm_120 cubins, graphs; the checkpoint carries a
    generation_config.json, which the build copies into tokenizer/ like Kimi's tokenizer files."""
    root = tmp_path_factory.mktemp("verify")
    target, drafter = synth(root / "ckpt", "tiny", seed=5)
    (target / "generation_config.json").write_text(json.dumps({"bos_token_id": 256, "eos_token_id": 257}))
    engine = Path(build_engine(target, drafter, 2, ["sm_120"], root / "engine")["engine"])
    return engine, target


@pytest.fixture
def copy(built, tmp_path):
    """A fresh copy of the engine to damage."""
    dst = tmp_path / "engine"
    shutil.copytree(built[0], dst)
    return dst


def flip(path: Path, at: int | None = None) -> None:
    """Flip the lowest bit of one byte (default: the middle one)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0x01
    path.write_bytes(bytes(data))


def edit_config(engine: Path, change, remanifest: bool = False) -> None:
    d = json.loads(ed.config_path(engine).read_text())
    change(d)
    ed.config_path(engine).write_text(json.dumps(d, indent=2))
    if remanifest:                      # edited, then the manifest rewritten to match: only the structure tells
        ed.write_manifest(engine)


def test_every_kind_of_engine_file_is_there(built):
    engine, _ = built
    listed = ed.read_manifest(engine)["files"]
    for rel in (WEIGHT, ed.CONFIG, "kernels/sm_120/moe.cubin", "graphs/rank0/moe_layer.onnx", "graphs/index.json",
                TOKENIZER_FILE):
        assert rel in listed and (engine / rel).is_file(), rel
    assert json.loads(ed.manifest_path(engine).read_text())["files_sha256"] == ed.files_checksum(listed)


def test_intact_engine_loads_verified(built):
    """Verified and unverified loads of an intact engine hold the same weights, and generate the same tokens."""
    from ddtree.runtime.engine import DDTreeEngine
    engine, _ = built
    meta, digests = ed.check_engine(engine)
    assert meta["tp"] == 2 and set(digests) == {f"rank{r}/{f}" for r in (0, 1) for f in meta["weight_files"]}
    hashed = ed.load_rank_tensors(engine, 1, meta["weight_files"], digests=digests)
    mapped = ed.load_rank_tensors(engine, 1, meta["weight_files"])
    assert list(hashed) == list(mapped)
    for name in mapped:
        assert hashed[name].dtype == mapped[name].dtype and np.array_equal(hashed[name], mapped[name]), name
    a = DDTreeEngine.load(str(engine)).generate("def f(x):", max_new_tokens=6)
    b = DDTreeEngine.load(str(engine), verify=False).generate("def f(x):", max_new_tokens=6)
    assert a.tokens == b.tokens and len(a.tokens) == 6


def test_plan_recomputed_by_the_runtime_equals_the_builders(built):
    """engine_dir.plan_per_rank (what a load checks against) is what builder/plan.py records, both modes."""
    engine, _ = built
    meta = ed.read_engine_config(engine)
    cfg, dcfg = KimiConfig.from_dict(meta["model"]), DrafterConfig.from_dict(meta["drafter"])
    assert meta["plan"]["per_rank"] == ed.plan_per_rank(cfg, dcfg, 2, "tp")
    for tp, experts in ((1, "tp"), (2, "ep"), (4, "tp"), (4, "ep")):
        plan = make_plan(cfg, dcfg, tp, experts).to_dict()
        assert plan["per_rank"] == ed.plan_per_rank(cfg, dcfg, tp, experts)
        assert plan["all_reduce_count"] == ed.plan_all_reduce_counts(cfg, dcfg)
        assert plan["per_rank"]["heads"] == cfg.num_attention_heads // tp       # an independent spot check
        assert plan["per_rank"]["routed_experts"] == (8 if experts == "tp" else 8 // tp)


@pytest.mark.parametrize("rel", [WEIGHT, "kernels/sm_120/moe.cubin", "graphs/rank0/moe_layer.onnx",
                                 "graphs/index.json", TOKENIZER_FILE])
def test_a_flipped_byte_stops_the_run_naming_the_file(copy, rel):
    """A CPU run never reads the cubins or the graphs; they are hashed all the same."""
    flip(copy / rel)
    refuses(["run", "--model", str(copy), "hi", *RUN], "EngineFormatError", f"{copy}/{rel}", "sha256 mismatch")


def test_a_flipped_byte_in_config_json(copy):
    """In a string (the recorded source path): the JSON still parses, only the hash tells."""
    text = ed.config_path(copy).read_bytes()
    flip(ed.config_path(copy), text.index(b'"source"') + 20)
    refuses(["run", "--model", str(copy), "hi", *RUN], "EngineFormatError", f"{copy}/config.json",
            "sha256 mismatch")


@pytest.mark.parametrize("where", ["middle", "hex digit"])
def test_a_flipped_byte_in_the_manifest(copy, where):
    """Not blamed on the file whose entry it hit: the manifest's own checksum (or its JSON) names it."""
    text = ed.manifest_path(copy).read_bytes()
    at = None if where == "middle" else text.index(b'"sha256": "') + 20
    flip(ed.manifest_path(copy), at)
    refuses(["run", "--model", str(copy), "hi", *RUN], "EngineFormatError", f"{copy}/manifest.json",
            "not a valid manifest")


def test_skip_verify_skips_the_hashes_only(copy):
    flip(copy / WEIGHT)
    r = ddtree(["run", "--model", str(copy), "hi", *RUN, "--skip-verify"])
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "2 new tokens" in r.stderr
    head = copy / "rank0/head.safetensors"
    head.write_bytes(head.read_bytes()[:-1])
    refuses(["run", "--model", str(copy), "hi", *RUN, "--skip-verify"], "EngineFormatError",
            f"{copy}/rank0/head.safetensors", f"size {head.stat().st_size} bytes")


def test_hand_edited_tp_is_named(copy):
    edit_config(copy, lambda d: d.update(tp=1))
    refuses(["run", "--model", str(copy), "hi", *RUN], "EngineFormatError", f"{copy}/config.json",
            "field 'tp' is 1", "plan.tp is 2", "edited after the build")


def test_hand_edited_model_dims_are_named_even_when_re_manifested(copy):
    """The manifest rewritten after the edit, and --skip-verify: the structural checks alone refuse."""
    def heads(d):
        d["model"]["text_config"]["num_attention_heads"] = 8
    edit_config(copy, heads, remanifest=True)
    refuses(["run", "--model", str(copy), "hi", *RUN, "--skip-verify"], "EngineFormatError", f"{copy}/config.json",
            "plan.per_rank.heads' is 2", "num_attention_heads 8", "gives 4")


def test_hand_edited_hidden_size_meets_the_weights(copy):
    """A dim the plan does not record: the weights' headers disagree (no weight is read)."""
    def hidden(d):
        d["model"]["text_config"]["hidden_size"] = 192
    edit_config(copy, hidden, remanifest=True)
    with pytest.raises(ed.EngineFormatError, match="model hidden_size is 192 but rank0/embed.safetensors holds"):
        ed.check_engine(copy, verify=False)


def _text(d):
    return d["model"]["text_config"]


EDITS = [     # (what a hand edit changes, fragments the refusal names), the manifest rewritten after it
    (lambda d: d.update(tp=4), ["field 'tp' is 4 but its plan.tp is 2"]),
    (lambda d: (d.update(tp=1), d["plan"].update(tp=1)), ["field 'tp' is 1", "2 rank directories (rank0, rank1)"]),
    (lambda d: d.update(experts="ep"), ["field 'experts' is 'ep' but its plan.experts is 'tp'"]),
    (lambda d: d.update(block_size=3), ["field 'block_size' is 3 but drafter block_size is 4"]),
    (lambda d: d.update(ranks=["rank0"]), ["field 'ranks' is ['rank0']"]),
    (lambda d: d["plan"].update(per_rank=[1]), ["field 'plan.per_rank' must be an object, got [1]"]),
    (lambda d: d["plan"].pop("all_reduce_count"), ["field 'plan.all_reduce_count' must be an object, got None"]),
    (lambda d: _text(d).update(vocab_size=1024), ["plan.per_rank.vocab' is 256", "vocab_size 1024", "gives 512"]),
    (lambda d: _text(d).update(n_routed_experts=16), ["plan.per_rank.routed_experts' is 8", "n_routed_experts 16"]),
    (lambda d: _text(d).update(num_hidden_layers=3), ["plan.all_reduce_count.target' is 9", "num_hidden_layers 3"]),
    (lambda d: d["drafter"].update(num_hidden_layers=3), ["all_reduce_count.drafter' is 6", "num_hidden_layers 3"]),
    (lambda d: _text(d).update(first_k_dense_replace=2), ["model first_k_dense_replace is 2", "layer 1", "is MoE"]),
    (lambda d: _text(d).update(kv_lora_rank=32), ["kv_a_proj_with_mqa.weight BF16 [48, 128]", "holds BF16 [80, 128]"]),
    (lambda d: d.update(weight_files=d["weight_files"][:-1]),
     ["rank0/drafter.safetensors: a weight file not in config.json field 'weight_files'"]),
    (lambda d: d.update(weight_files=[*d["weight_files"], "extra.safetensors"]),
     ["field 'weight_files' lists extra.safetensors but rank0/extra.safetensors is not in manifest.json"]),
    (lambda d: d["kernels"].update(sm_90={}), ["field 'kernels' has arch 'sm_90', not in field 'archs'"]),
]


@pytest.mark.parametrize("change,names", EDITS)
def test_config_edits_are_named_by_the_structural_checks(copy, change, names):
    """In process (no hashes, manifest rewritten): each edit is found by the structure alone."""
    edit_config(copy, change, remanifest=True)
    with pytest.raises(ed.EngineFormatError) as e:
        ed.check_engine(copy, verify=False)
    assert str(e.value).startswith(f"{copy}/"), e.value
    for name in names:
        assert name in str(e.value), (name, str(e.value))


def test_manifest_entry_not_an_object(copy):
    m = json.loads(ed.manifest_path(copy).read_text())
    m["files"][ed.CONFIG] = 7727
    m["files_sha256"] = ed.files_checksum(m["files"])         # consistent with itself: the entry is named
    ed.manifest_path(copy).write_text(json.dumps(m))
    refuses(["run", "--model", str(copy), "hi", *RUN], "EngineFormatError", f"{copy}/manifest.json",
            "entry 'config.json' must be an object", "got 7727")


def test_inspect(built, copy):
    """inspect shares the checks: its 'files' not an object is named; a checkpoint is not an engine."""
    engine, target = built
    m = json.loads(ed.manifest_path(copy).read_text())
    m["files"] = list(m["files"])
    ed.manifest_path(copy).write_text(json.dumps(m))
    refuses(["inspect", str(copy)], "EngineFormatError", f"{copy}/manifest.json", "field 'files' must be an object")
    refuses(["inspect", str(target)], "EngineFormatError", str(target), "not an engine directory", "manifest.json",
            "checkpoint")


def test_graph_runner_load_verifies_too(copy):
    """runtime/graph_ranks.GraphRanks.from_engine goes through the same check and the same hashing loader."""
    pytest.importorskip("onnx")
    from ddtree.runtime.graph_ranks import GraphRanks
    flip(copy / WEIGHT)
    with pytest.raises(ed.EngineFormatError, match=re.escape(f"{copy}/{WEIGHT}: sha256 mismatch")):
        GraphRanks.from_engine(copy)
    assert GraphRanks.from_engine(copy, verify=False).tp == 2          # the hashes skipped, the rest checked
    edit_config(copy, lambda d: d.update(tp=1))
    with pytest.raises(ed.EngineFormatError, match=re.escape(f"{copy}/config.json: field 'tp' is 1")):
        GraphRanks.from_engine(copy, verify=False)
