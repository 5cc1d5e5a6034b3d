"""The fixture of the TensorRT plugin GPU test: what every `ddtree` plugin of a built plan is given and must return.

    python -m tests.backends.trt_plugin_calls            # rewrites tests/fixtures/backends/trt_plugin_calls.{json,npz}

1. Builds the embedded tiny model at tp 1 with its SM120 TensorRT-RTX plans (CPU-only) and records, for every
   ddtree plugin TensorRT created, the fields it serialised into the plan (get_fields_to_serialize: the buffers a
   plan stores and create_plugin(RUNTIME) reads back).
2. Runs the engine's own bf16 graphs with onnx.reference (runtime/graph_ranks.py GraphRanks) for a prompt and three
   DDTree steps at budget 16 (greedy, then sampled at temperature 0.75, then greedy), drafter and target caches
   carried, accepted paths compacted, and records each ddtree node's inputs and outputs (its numpy
   implementation, backends/onnx_nodes.py: the reference the plugin's kernels are held to).
3. Keeps, per op, up to three calls with one set of input shapes (one graph capture serves them) and the fields
   of a plan node with those attributes.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "backends" / "trt_plugin_calls"
TINY = Path(__file__).resolve().parents[2] / "ddtree" / "data" / "tiny"
PROMPT = np.array([256] + list(b"def fib(n):\n    return"))
BUDGET, CALLS = 16, 3
TRT_DTYPES = ("bfloat16", "float32", "int32")


def _dtype_name(a: np.ndarray) -> str:
    if a.dtype.name not in TRT_DTYPES:                 # ml_dtypes' bf16 is named "bfloat16"
        raise TypeError(f"node tensor of dtype {a.dtype}")
    return a.dtype.name


def _bits(a: np.ndarray) -> np.ndarray:
    """bf16 arrays as their uint16 bits (npz keeps no ml_dtypes)."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint16) if a.dtype.name == "bfloat16" else a


def build_engine(out: Path) -> Path:
    from click.testing import CliRunner

    from ddtree.cli import main
    r = CliRunner().invoke(main, ["build", "--model", str(TINY / "target"), "--drafter", str(TINY / "drafter"),
                                  "--tp", "1", "--arch", "sm_120", "--out", str(out), "--trt", "--json"])
    if r.exit_code:
        raise RuntimeError(r.output)
    return out


def plan_fields(engine: Path) -> list[dict]:
    """Every plugin TensorRT created building rank 0's plans: plan, node name, op, attrs and serialised fields."""
    from ddtree import engine_dir as ed
    from ddtree.backends.tensorrt import creators
    from ddtree.builder.trt_build import build_plan
    creators.register_creators()
    dims = json.loads(ed.graphs_index_path(engine).read_text())["dims"]
    plans = json.loads(ed.plans_path(engine).read_text())["plans"]
    found, created = [], []
    original = creators.DdtreeCreator.create_plugin

    def recording(self, name, fields, phase):
        plugin = original(self, name, fields, phase)
        created.append((name, plugin))
        return plugin
    creators.DdtreeCreator.create_plugin = recording
    try:
        for plan, p in sorted(plans.items()):
            if p["rank"]:
                continue
            created.clear()
            build_plan(creators.trt, engine / p["graph"], dims)
            for name, plugin in created:
                fields = [(f.name, np.array(f.data, copy=True), plugin.spec.fields[f.name])
                          for f in plugin.get_fields_to_serialize()]
                found.append({"plan": plan, "node": name, "op": plugin.spec.op, "attrs": plugin.attrs,
                              "fields": [(n, a.tolist(), k) for n, a, k in fields]})
    finally:
        creators.DdtreeCreator.create_plugin = original
    return found


def node_calls(engine: Path) -> list[dict]:
    """Each ddtree node call of a prompt and three DDTree steps on the engine's bf16 graphs (onnx.reference)."""
    from ddtree.backends import onnx_nodes
    from ddtree.reference.model import causal_visible
    from ddtree.runtime.graph_ranks import GraphRanks, mask_words
    calls = []
    originals = {op: op._run for op in onnx_nodes.OPS}

    def recorder(op):
        def _run(self, *inputs, **attrs):
            outputs = originals[op](self, *inputs, **attrs)
            calls.append({"op": op.__name__, "node": self.onnx_node.name, "attrs": attrs,
                          "inputs": [np.array(x, copy=True) for x in inputs],
                          "outputs": [np.array(y, copy=True) for y in outputs]})
            return outputs
        return _run
    for op in onnx_nodes.OPS:
        op._run = recorder(op)
    try:
        g = GraphRanks.from_engine(engine)
        d = g.dcfg
        P, taps = len(PROMPT), d.target_layer_ids
        caches, dcaches = g.new_target_caches(128), g.new_drafter_caches(128)
        pre = g.target_forward(PROMPT, np.arange(P), mask_words(causal_visible(0, P)), caches, taps)
        bonus = int(pre.logits[-1].astype(np.float64).argmax())
        ctx = np.concatenate([pre.taps[L] for L in taps], axis=1)
        start = P
        for step, temperature in enumerate((0.0, 0.75, 0.0)):
            draft = g.drafter_forward([bonus] + [d.mask_token_id] * (d.block_size - 1),
                                      np.arange(start, start + d.block_size), ctx, dcaches)
            tree = g.tree_build(bonus, draft.candidates, BUDGET)
            pos = start + tree["depth"].astype(np.int64)
            out = g.target_forward(tree["tokens"], pos, tree["visibility"], caches, taps, temperature=temperature,
                                   seed=1234 + step)
            walk = g.accept(tree["tokens"], tree["parents"], out.winners)
            n = int(walk["accepted_count"][0])
            g.compact(caches, start, walk["accepted"], n)
            rows = walk["accepted"][:n]
            ctx = np.concatenate([out.taps[L][rows] for L in taps], axis=1)
            bonus, start = int(walk["bonus"][0]), start + n
    finally:
        for op in onnx_nodes.OPS:
            op._run = originals[op]
    return calls


def select(calls: list[dict], fields: list[dict]) -> tuple[dict, dict]:
    """Per op: the most frequent input shapes' first CALLS calls, and the plan fields of a node with their attrs."""
    meta, arrays = {}, {}
    ops = sorted({c["op"] for c in calls})
    for op in ops:
        mine = [c for c in calls if c["op"] == op]
        shapes = lambda c: tuple(tuple(x.shape) for x in c["inputs"])       # noqa: E731
        best = max({shapes(c) for c in mine}, key=lambda s: sum(shapes(c) == s for c in mine))
        chosen = [c for c in mine if shapes(c) == best][:CALLS]
        attrs = chosen[0]["attrs"]
        plan_node = next(f for f in fields if f["op"] == op and f["attrs"] == attrs)
        meta[op] = {"node": chosen[0]["node"], "plan": plan_node["plan"], "plan_node": plan_node["node"],
                    "attrs": plan_node["attrs"], "fields": plan_node["fields"], "calls": len(chosen),
                    "in_types": [_dtype_name(x) for x in chosen[0]["inputs"]],
                    "out_types": [_dtype_name(y) for y in chosen[0]["outputs"]]}
        for i, c in enumerate(chosen):
            for j, x in enumerate(c["inputs"]):
                arrays[f"{op}/{i}/in{j}"] = _bits(x)
            for j, y in enumerate(c["outputs"]):
                arrays[f"{op}/{i}/out{j}"] = _bits(y)
    return meta, arrays


def make(root: Path) -> tuple[dict, dict]:
    engine = build_engine(root / "tiny-tp1-trt")
    return select(node_calls(engine), plan_fields(engine))


def load() -> tuple[dict, dict]:
    meta = json.loads(FIXTURE.with_suffix(".json").read_text())
    with np.load(FIXTURE.with_suffix(".npz")) as z:
        return meta, {k: z[k] for k in z.files}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        meta, arrays = make(Path(tmp))
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.with_suffix(".json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    np.savez_compressed(FIXTURE.with_suffix(".npz"), **arrays)
    print(f"{FIXTURE}: {len(meta)} ops, {sum(m['calls'] for m in meta.values())} calls, "
          f"{FIXTURE.with_suffix('.npz').stat().st_size} bytes")
