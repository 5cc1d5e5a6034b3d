"""`ddtree-build --trt` on this CPU-only machine: SM120 TensorRT-RTX plans per rank and graph kind.
Every ddtree op type is a plugin layer of some plan; each plan's inputs and outputs are its ONNX
graph's; `ddtree inspect` lists them; every plugin's serialised fields rebuild it (RUNTIME phase)
with exactly the attributes of its ONNX node. Plans cannot run here (no SM120 GPU)."""
import json
import subprocess
import sys

import onnx
import pytest
from click.testing import CliRunner

from ddtree.backends.onnx_export import io_of
from ddtree.cli import main
from ddtree.description.nodes import NODES
from ddtree.engine_dir import graphs_index_path, manifest_path, plan_rel, plans_path

pytestmark = pytest.mark.trt


@pytest.fixture(scope="module")
def trt_engine(checkpoint, tmp_path_factory):
    """A tp = 2 engine built through the CLI with --trt."""
    out = tmp_path_factory.mktemp("trt") / "tiny-tp2"
    target, drafter = checkpoint("tiny")
    r = CliRunner().invoke(main, ["build", "--model", str(target), "--drafter", str(drafter), "--tp", "2",
                                  "--arch", "sm_120", "--out", str(out), "--trt", "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    return out, summary, json.loads(plans_path(out).read_text())


def test_plans_cover_every_ddtree_op(trt_engine):
    out, summary, plans = trt_engine
    index = json.loads(graphs_index_path(out).read_text())
    assert summary["plans"] == len(plans["plans"]) == 2 * len(index["kinds"])
    assert plans["compute_capability"] == "12.0"
    seen = set()
    for name, p in plans["plans"].items():
        blob = (out / name).read_bytes()
        graph = onnx.load(out / p["graph"])
        ops_in_graph = {n.op_type for n in graph.graph.node if n.domain == "ddtree"}
        assert set(p["plugins"]) == ops_in_graph, name            # every ddtree node became a plugin layer
        for op in p["plugins"]:
            assert op.encode() in blob, f"{name}: plugin {op} is not in the plan"
        seen |= set(p["plugins"])
    assert seen == set(NODES)


def test_plan_io_matches_its_graph(trt_engine):
    out, _, plans = trt_engine
    manifest = json.loads(manifest_path(out).read_text())["files"]
    assert "plans.json" in manifest
    for name, p in plans["plans"].items():
        assert name in manifest and manifest[name]["size"] == p["bytes"] == (out / name).stat().st_size
        inputs, outputs = io_of(onnx.load(out / p["graph"]))
        for recorded, declared in ((p["inputs"], inputs), (p["outputs"], outputs)):
            assert [t["name"] for t in recorded] == [t["name"] for t in declared], name
            for r, d in zip(recorded, declared):
                assert r["dtype"] == d["dtype"], (name, r["name"])
                assert r["shape"] == [-1 if isinstance(s, str) else s for s in d["shape"]], (name, r["name"])
        blob = (out / name).read_bytes()
        for t in p["inputs"] + p["outputs"]:
            assert t["name"].encode() in blob, f"{name}: tensor {t['name']} is not in the plan"


def test_inspect_lists_plan_io(trt_engine):
    out, _, plans = trt_engine
    r = CliRunner().invoke(main, ["inspect", str(out), "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info["ok"] and info["plans"] == plans
    assert "moe_layer" in r.stderr and "tree_mask int32[-1, -1]" in r.stderr and "MlaTreeAttention" in r.stderr


def run_fresh(script: str, out) -> str:
    """`script` in a fresh interpreter with the engine dir as argv[1] -> its stdout; a native crash there fails the
    calling test with the script's output instead of ending the whole pytest run."""
    run = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    return run.stdout


ROUND_TRIP = """
import json, sys
from pathlib import Path
import numpy as np
import onnx
from ddtree.builder.trt_build import build_plan
from ddtree.engine_dir import graphs_index_path, plans_path
from ddtree.description.nodes import NODES
from ddtree.backends.tensorrt import creators
from ddtree.backends.tensorrt.fields import node_attrs
trt, out = creators.trt, Path(sys.argv[1])
registered = creators.register_creators()       # registered before the patch, as a build of this process had
created = []
original = creators.DdtreeCreator.create_plugin

def recording(self, name, fields, phase):
    plugin = original(self, name, fields, phase)
    serialised = [(f.name, np.array(f.data, copy=True), f.type) for f in plugin.get_fields_to_serialize()]
    assert plugin.get_fields_to_serialize() is plugin.get_fields_to_serialize(), "a rebuilt collection frees the last"
    created.append((name, phase, plugin.spec.op, dict(plugin.attrs), serialised))
    return plugin
creators.DdtreeCreator.create_plugin = recording
dims = json.loads(graphs_index_path(out).read_text())["dims"]
checked = set()
for p in json.loads(plans_path(out).read_text())["plans"].values():
    created.clear()
    build_plan(trt, out / p["graph"], dims)
    nodes = {n.name: n for n in onnx.load(out / p["graph"]).graph.node if n.domain == "ddtree"}
    parsed = list(created)                      # the RUNTIME creations below go through `recording` too
    assert {name for name, *_ in parsed} == set(nodes), (p["graph"], sorted(nodes))
    for name, phase, op, attrs, serialised in parsed:
        assert phase == trt.TensorRTPhase.BUILD, (name, phase)
        want = node_attrs(nodes[name])
        assert attrs == want, (name, attrs, want)
        fields = trt.PluginFieldCollection([trt.PluginField(n, a, t) for n, a, t in serialised])
        runtime = registered[op].create_plugin(name, fields, trt.TensorRTPhase.RUNTIME)
        assert runtime.attrs == want and runtime.phase == trt.TensorRTPhase.RUNTIME, (name, runtime.attrs, want)
        assert [type(v) for v in runtime.attrs.values()] == [type(v) for v in want.values()], name
        checked.add(op)
assert checked == set(NODES), sorted(set(NODES) - checked)
print("checked", len(checked))
"""


def test_plugin_fields_round_trip_through_runtime_creation(trt_engine):
    """The plugins TensorRT's parser creates (BUILD) from each node -> get_fields_to_serialize ->
    creator.create_plugin(RUNTIME) -> the node's attributes, exactly. In a fresh interpreter, so that a native
    crash fails this test with its output instead of ending the whole pytest run: the plugin rebuilt its field
    collection on every get_fields_to_serialize, freeing one TensorRT could still hold, and this check aborted in
    about one run of three here ("malloc(): unaligned tcache chunk detected"; about one in twenty once it was built
    once, from the RUNTIME plugins this check drops: test_plugins_dropped_after_a_build)."""
    out, _, _ = trt_engine
    stdout = run_fresh(ROUND_TRIP, out)
    assert stdout.split()[-1] == str(len(NODES)), stdout


DROP_AFTER_BUILD = """
import json, sys
from pathlib import Path
from ddtree.builder.trt_build import build_plan
from ddtree.engine_dir import graphs_index_path, plans_path
from ddtree.description.nodes import NODES
from ddtree.backends.tensorrt import creators
out = Path(sys.argv[1])
creators.register_creators()
dims = json.loads(graphs_index_path(out).read_text())["dims"]
for p in json.loads(plans_path(out).read_text())["plans"].values():
    build_plan(creators.trt, out / p["graph"], dims)
value = {"int": 1, "float": 1.0, "str": "yarn", "ints": [1, 2]}
for _ in range(200):
    for spec in NODES.values():
        plugin = creators.DdtreePlugin(spec, {n: value[k] for n, k in spec.fields.items()})
        plugin.get_fields_to_serialize()
        del plugin
print("dropped", 200 * len(NODES))
"""


def test_plugins_dropped_after_a_build(trt_engine):
    """Plugins created and dropped in Python after TensorRT built (and deleted) plugins in the same process: the
    bindings' destructor released the stale Python objects of TensorRT's deleted plugins until one was freed twice
    (creators._never_freed); this script aborted in 20 of 20 runs before, "malloc(): unaligned tcache chunk"."""
    out, _, _ = trt_engine
    stdout = run_fresh(DROP_AFTER_BUILD, out)
    assert stdout.split()[-1] == str(200 * len(NODES)), stdout


def test_cache_outputs_are_aliased_to_their_inputs(trt_engine, monkeypatch):
    """TensorRT sees the in-place caches: without the aliasing preview feature the layer plans do not build."""
    from ddtree.backends.tensorrt.creators import trt
    from ddtree.builder.trt_build import PlanBuildError, build_plan
    out, _, plans = trt_engine
    dims = json.loads(graphs_index_path(out).read_text())["dims"]
    original = trt.IBuilderConfig.set_preview_feature
    monkeypatch.setattr(trt.IBuilderConfig, "set_preview_feature", lambda self, feature, on: original(self, feature, False))
    for kind, node in (("moe_layer", "attn.kv_append"), ("draft_layer", "draft.attention")):
        with pytest.raises(PlanBuildError, match=f"Aliased I/O used by plugin {node}"):
            build_plan(trt, out / plans["plans"][plan_rel(0, kind)]["graph"], dims)


def test_plugin_runtime_needs_attach_and_a_wired_kernel():
    """enqueue / on_shape_change before attach_to_context say so; attaching a node whose kernels are not wired
    fails there (at context creation), naming the kernel, before any enqueue."""
    from ddtree.backends.tensorrt.creators import DdtreePlugin, trt
    from ddtree.backends.tensorrt.kernels import MissingKernelError
    desc = trt.PluginTensorDesc()
    desc.dims, desc.type = trt.Dims([4, 8]), trt.DataType.BF16
    anything = lambda spec: {n: {"int": 1, "float": 1.0, "str": "yarn"}[k] for n, k in spec.fields.items()}  # noqa: E731
    spec = NODES["MlaTreeAttention"]
    plugin = DdtreePlugin(spec, anything(spec))
    with pytest.raises(RuntimeError, match="MlaTreeAttention plugin: used before attach_to_context"):
        plugin.enqueue([desc] * 5, [desc], [0] * 5, [0], 0, 0)
    with pytest.raises(RuntimeError, match="used before attach_to_context"):
        plugin.on_shape_change([desc] * 5, [desc])
    assert plugin.attach_to_context(None).runner is not None
    for spec in (s for s in NODES.values() if not s.wired):
        with pytest.raises(MissingKernelError, match=f"{spec.op} plugin cannot run: its enqueue does not launch"):
            DdtreePlugin(spec, anything(spec)).attach_to_context(None)


def test_plugin_call_fixture_is_what_the_plans_serialise(tmp_path):
    """The GPU plugin test's fixture (tests/backends/trt_plugin_calls.py) holds the fields today's build serialises for
    those plan nodes, and every field name is in the plan."""
    from tests.backends.trt_plugin_calls import build_engine, load, plan_fields
    meta, arrays = load()
    engine = build_engine(tmp_path / "tiny-tp1-trt")
    fields = {(f["plan"], f["node"]): f for f in plan_fields(engine)}
    assert set(meta) == set(NODES)
    for op, m in meta.items():
        f = fields[(m["plan"], m["plan_node"])]
        assert f["op"] == op and f["attrs"] == m["attrs"] and [list(x) for x in f["fields"]] == m["fields"], op
        blob = (engine / m["plan"]).read_bytes()
        assert all(name.encode() in blob for name, _, _ in m["fields"]), op
        assert all(f"{op}/0/in{j}" in arrays for j in range(len(NODES[op].inputs))), op
