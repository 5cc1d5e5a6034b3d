"""The projection of one DDTree step to the product machine (issue 21, docs/interfaces.md section 10).

A PROJECTION, not a measurement. Per op call of the step (a meter record, ddtree/backends/meter.py):

    us = fixed_us + bytes / (efficiency x bandwidth) + flops / (flop_efficiency x bf16 rate)

with (fixed_us, efficiency, flop_efficiency) of the op's kernel class, fitted on the H200 (`fit_class`:
least squares of us - flops / rate against bytes, over measured rows) and carried to the target device
unchanged: the fixed cost per call stays, the byte term runs at the same share of the new device's
bandwidth. Collectives are counted from the meter records (how many, which message sizes) and each
costs `AllReduceModel.us` of the model choose_protocol takes for its size (parallel/collective_models.py: the
cheapest; a row names it): latency_us + bytes (tp - 1) / tp / bandwidth. The step's tokens per second
is accept_len / step time, accept_len from a named `AcceptSource`. Every number here is a field.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ddtree.backends.meter import totals
from ddtree.errors import InputError
from ddtree.parallel.collective_models import (  # noqa: F401  (AllReduceModel, ONE_SHOT, TWO_SHOT, NCCL: re-exported)
    MODEL_CHOICES,
    NCCL,
    ONE_SHOT,
    TWO_SHOT,
    AllReduceModel,
    choose_protocol,
    chosen_model,
    models_for,
)
from ddtree.tree.build import Tree


class MeasuredRowsError(InputError):
    """A --measured file (or its rows) that cannot give a fit."""


@dataclass(frozen=True)
class Device:
    name: str
    bandwidth_tbps: float            # the byte term's 100 %: copy ceiling (H200) or spec (target)
    bf16_tflops: float               # the FLOP term's 100 %: dense bf16 tensor rate
    source: str


H200 = Device("H200 SXM", 4.2, 989.0,
              "copy ceiling measured 4.12-4.24 TB/s (ddtree/plugins/kernels/NOTES.md); "
              "989 TFLOPS dense bf16 spec (docs/hardware-and-kernels.md section 1)")
H100 = Device("H100 SXM", 3.0, 989.0,
              "copy ceiling measured 2.99-3.03 TB/s (ddtree bench step files, docs/measured/*_h100_*); "
              "989 TFLOPS dense bf16 spec")
PRO_6000 = Device("RTX PRO 6000 Blackwell", 1.79, 503.8,
                  "1792 GB/s GDDR7 (Workstation) and 503.8 TFLOPS dense bf16 spec, cuBLAS measured 350-368 "
                  "(docs/hardware-and-kernels.md section 1)")


@dataclass(frozen=True)
class KernelClass:
    name: str
    fixed_us: float                  # per op call (its launches, ramp, hand-offs), device-independent
    efficiency: float                # achieved share of the device bandwidth on the byte term
    flop_efficiency: float           # achieved share of the dense bf16 rate on the FLOP term
    source: str

    def us(self, dev: Device, nbytes: float, flops: float) -> float:
        return (self.fixed_us + nbytes / (self.efficiency * dev.bandwidth_tbps * 1e6)
                + flops / (self.flop_efficiency * dev.bf16_tflops * 1e6))


@dataclass(frozen=True)
class AcceptSource:
    name: str
    source: str
    constant: float | None = None                  # the same accept length at every budget
    by_budget: dict = field(default_factory=dict)  # budget -> accept length
    source_budget: int | None = None               # the drafted tokens `constant` was measured at

    def accept_len(self, budget: int) -> float:
        if self.constant is not None:
            return self.constant
        if budget not in self.by_budget:
            raise InputError(f"--accept {self.name}: no accept length for budget {budget} "
                             f"(known: {', '.join(map(str, sorted(self.by_budget)))})")
        return self.by_budget[budget]


def fit_line(x, y) -> tuple[float, float]:
    """Least squares y = a + b x -> (a, b); a < 0 refits through the origin (a = 0)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    a, b = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), y, rcond=None)[0]
    if a < 0:
        a, b = 0.0, float(x @ y / (x @ x))
    return float(a), float(b)


def fit_class(name: str, rows, dev: Device, flop_efficiency: float, source: str) -> KernelClass:
    """rows [(bytes, flops, measured us)] of one class on `dev` -> fixed_us and efficiency by least squares."""
    rows = [tuple(map(float, r)) for r in rows]
    if len({r[0] for r in rows}) < 2:
        raise MeasuredRowsError(f"kernel class {name!r}: a fit needs rows at >= 2 different byte counts, "
                                f"got {len(rows)} row(s)")
    y = [us - flops / (flop_efficiency * dev.bf16_tflops * 1e6) for _, flops, us in rows]
    fixed, us_per_byte = fit_line([r[0] for r in rows], y)
    if us_per_byte <= 0:
        raise MeasuredRowsError(f"kernel class {name!r}: time does not grow with bytes (slope {us_per_byte:.3g})")
    return KernelClass(name, fixed, 1.0 / (us_per_byte * dev.bandwidth_tbps * 1e6), flop_efficiency, source)


# op of a meter record -> kernel class; collectives (all_reduce, all_gather) cost only their model
OP_CLASS = {"moe.experts": "moe", "moe.router": "router", "moe.shared": "gemm", "linear": "gemm",
            "swiglu_mlp": "gemm", "mla_absorb_q": "gemm", "mla_absorb_q_rope": "gemm",
            "mla_absorb_out": "gemm",
            "mla_tree_attention": "attention", "draft_attention": "attention",
            "vocab_winner": "tree", "vocab_topk": "tree", "tree_build": "tree", "accept_walk": "tree",
            "add": "elementwise", "rms_norm": "elementwise", "rope": "elementwise", "kv_append": "elementwise",
            "kv_append_normed": "elementwise", "kv_compact": "elementwise", "embed": "elementwise",
            "cast": "elementwise",
            "kv_append_requests": "elementwise", "mla_tree_attention_requests": "attention",   # the union verify's
            "all_reduce_add_rms_norm": "elementwise", "all_reduce": None, "all_gather": None}
PHASES = ("attention", "moe", "router", "dense", "lm_head", "drafter", "tree", "allreduce")
ATTENTION_OPS = {"mla_absorb_q", "mla_absorb_q_rope", "mla_tree_attention", "mla_absorb_out", "kv_append",
                 "kv_append_normed", "rope", "kv_append_requests", "mla_tree_attention_requests"}


def phase_of(rec) -> str:
    """The split key (docs/interfaces.md section 10) of a record's time; collectives: 'allreduce'."""
    if rec.kind.startswith("draft_"):
        return "drafter"
    if rec.kind in ("tree", "accept"):
        return "tree"
    if rec.kind == "head":
        return "lm_head"
    if rec.kind == "compact" or rec.op in ATTENTION_OPS:
        return "attention"
    if rec.op == "moe.router":
        return "router"
    if rec.op in ("moe.experts", "moe.shared"):
        return "moe"
    return "dense"


def collective_us(models, nbytes: float, tp: int) -> float:
    """One collective of nbytes among tp ranks: the cheapest of the AllReduceModels (the one choose_protocol takes)."""
    return chosen_model(nbytes, tp, models).us(nbytes, tp)


def message_bytes(rec, tp: int) -> int:
    """The bytes a meter record's collective moves as one message: an all-gather's tp parts together."""
    return rec.message_bytes * (tp if rec.collective == "all_gather" else 1)


@dataclass(frozen=True)
class Projection:
    """Everything the step's projected time depends on, each a field."""
    device: Device
    classes: dict                    # class name -> KernelClass
    allreduce: tuple                 # AllReduceModels; a collective costs the cheapest (choose_protocol)
    tp: int
    hidden: float = 0.0              # the fraction of the collectives' time the step hides (measured: bench step
    hidden_source: str = "none: every collective adds its whole time"   # --collectives copy,pcie)

    def collective_us(self, nbytes: float, op: str = "all_reduce") -> float:
        """One collective `op` whose message is nbytes (an all-gather's: every rank's part together)."""
        return collective_us(models_for(op, self.allreduce), nbytes, self.tp)

    def chosen(self, nbytes: float, op: str = "all_reduce") -> str:
        """The implementation a rank process takes for it (parallel/rank_collective.py chooses the same way)."""
        return choose_protocol(nbytes, self.tp, models_for(op, self.allreduce))

    def step(self, records) -> dict:
        """Meter records of one step -> {"step_us", "split_us": {phase: us}, "by_class_us", "collectives"}."""
        split = dict.fromkeys(PHASES, 0.0)
        by_class: Counter = Counter()
        messages: Counter = Counter()
        for r in records:
            cls = OP_CLASS[r.op]
            if cls is not None:
                us = self.classes[cls].us(self.device, r.read + r.written, r.flops)
                split[phase_of(r)] += us
                by_class[cls] += us
            if r.collective:
                messages[(r.collective, message_bytes(r, self.tp))] += 1
        collectives = [{"op": op, "message_bytes": nbytes, "count": n, "collective": self.chosen(nbytes, op),
                        "us_each": self.collective_us(nbytes, op), "us": n * self.collective_us(nbytes, op)}
                       for (op, nbytes), n in sorted(messages.items())]
        split["allreduce"] = sum(c["us"] for c in collectives) * (1.0 - self.hidden)
        by_class["collectives"] = split["allreduce"]
        return {"step_us": sum(split.values()), "split_us": split, "by_class_us": dict(by_class),
                "collectives": collectives}

    def assumptions(self) -> dict:
        return {"target": f"{self.tp}x {self.device.name}", "bandwidth_tbps": self.device.bandwidth_tbps,
                "bf16_tflops": self.device.bf16_tflops, "device_source": self.device.source,
                "allreduce_model": {"choice": "cheapest per message" if len(self.allreduce) > 1 else "single",
                                    "models": [asdict(m) for m in self.allreduce],
                                    "hidden_fraction": self.hidden, "hidden_source": self.hidden_source},
                "kernel_classes": {k: asdict(c) for k, c in sorted(self.classes.items())},
                "fixed_cost": "per op call, carried from the H200 fit unchanged"}


def depth_histogram(tree: Tree) -> list[int]:
    """Nodes per depth of a tree (ddtree/tree/build.py Tree), root (depth 0) first."""
    return np.bincount(tree.depth).tolist()


def priced_row(proj: Projection, accept: AcceptSource, context: int, budget: int, routing: str, reuse: float | None,
               tree: Tree, recs, experts: dict) -> dict:
    """A `bench project` row from a step's meter records `recs` and its distinct experts: priced on the target,
    tokens/s = accept_len / step (bench/project.py prices one request's step, bench/project_requests.py R's)."""
    t, step = totals(recs), proj.step(recs)
    accept_len = accept.accept_len(budget)
    step_s = step["step_us"] * 1e-6
    nbytes = t["read"] + t["written"]
    split_ms = {k2: v / 1e3 for k2, v in step["split_us"].items()}
    return {"context": context, "budget": budget, "routing": routing, "reuse": reuse, "bytes": nbytes,
            "flops": t["flops"], "kernels": t["kernels"], "distinct_experts": experts,
            "tree": {"nodes": tree.size, "depth_histogram": depth_histogram(tree)},
            "projection": {
                "target": f"{proj.tp}x RTX PRO 6000", "bandwidth_tbps": proj.device.bandwidth_tbps,
                "bf16_tflops": proj.device.bf16_tflops, "allreduce_model": proj.assumptions()["allreduce_model"],
                "accept_len": accept_len, "accept_source": accept.source,
                "accept_source_budget": accept.source_budget, "step_ms": step_s * 1e3,
                "tokens_per_s": accept_len / step_s, "ideal_ms": nbytes / (proj.device.bandwidth_tbps * 1e9),
                "split_ms": split_ms, "by_class_ms": {c: v / 1e3 for c, v in step["by_class_us"].items()},
                "collectives": step["collectives"],
                "dominant": sorted(split_ms, key=split_ms.get, reverse=True)[:3]}}


# ----------------------------------------------------------------------------------------------
# The hand-made split (no --measured file): H200 constants per kernel class. NOTES below is
# ddtree/plugins/kernels/NOTES.md. The fitted ones are fit_class over rows transcribed from NOTES
# (bytes = ideal us x 4.2 TB/s, or MB / share of the ceiling); tests/bench/test_projection.py refits
# those rows and checks these numbers.
NOTES = "ddtree/plugins/kernels/NOTES.md"
HAND_SPLIT = {
    # NOTES "Follow-up", MoE TP8 at M = 1, 2, 4, 8, 16, 64 (ideal 5.9 .. 208.7 us, measured 27.6 .. 325.6),
    # less the route kernel's 3.6 us (the split of TP8 M=1); FLOPs 2 M k 3 I H at the dense rate
    "moe": KernelClass("moe", 11.35, 0.686, 1.0, f"fit of {NOTES} MoE TP8 M 1..64 (route removed)"),
    # NOTES "Follow-up", skinny GEMM TP8 at M = 16: lm_head 294 MB 74 %, dense_gate_up 66 MB 53 %,
    # dense_down 33 MB 42 %, q_b 5 MB 19 %, shared_gate_up 7 MB 24 % of the ceiling
    "gemm": KernelClass("gemm", 6.84, 0.835, 1.0, f"fit of {NOTES} skinny GEMM TP8 M=16 rows"),
    # NOTES issue 7 table, H 8, T 4096 / 32768 / 131072, q 4 / 8 / 16 / 64; the FLOP term at 20 % of
    # the dense rate ("the tree form stops near 20 % of the H200's dense rate")
    "attention": KernelClass("attention", 19.57, 0.952, 0.2, f"fit of {NOTES} MLA H8 q 4..64 rows, FLOPs at 20 %"),
    # NOTES: the route kernel takes 3.1-3.6 us at every M; its 5.5 MB router weight is 1.3 us at the ceiling
    "router": KernelClass("router", 2.0, 1.0, 1.0, f"{NOTES} route kernel 3.1-3.6 us: 2.0 fixed + bytes"),
    # NOTES issue 8: V 32768 B 64 greedy, build 47.5 + walk 10.7 us over 4 op calls (~12-15 us each);
    # logits read once at ~3.7 TB/s (0.88 of the ceiling)
    "tree": KernelClass("tree", 12.0, 0.88, 1.0, f"{NOTES} tree build + walk, V 32768 B 64: ~12 us a call"),
    # unmeasured: norms, rope, adds, KV append / compact, embedding. 2 us a call is the "2-3 us gap per
    # kernel" of docs/hardware-and-kernels.md section 3; half the ceiling is an assumption
    "elementwise": KernelClass("elementwise", 2.0, 0.5, 1.0,
                               "assumed: 2 us a call (docs/hardware-and-kernels.md section 3), 50 % of bandwidth"),
}

# All-reduce over PCIe, 8x RTX PRO 6000: ONE_SHOT, NCCL (fits) and TWO_SHOT (derived from the one-shot fit) live
# in parallel/collective_models.py, where the rank processes' choice by size reads them too.
ALLREDUCE_CHOICES = MODEL_CHOICES

# Acceptance length per budget (committed tokens per step, the bonus token included).
KIMI_DFLASH_CARD = AcceptSource(
    "kimi-dflash-card",
    "z-lab/Kimi-K2.5-DFlash model card (docs/ddtree.md section 4.3): SGLang DFlash CHAIN, block 8 "
    "(--speculative-num-draft-tokens 8, 7 drafted), thinking on, MBPP 4.5. No DDTree measurement on Kimi "
    "exists; held at every budget (a tree of B >= 7 nodes should accept at least as much, B < 7 less)",
    constant=4.5, source_budget=7)
TINY_MODEL = AcceptSource(
    "tiny", "ddtree's embedded TINY model (6 M parameters, byte tokenizer), docs/tiny-model.md `ddtree bench accept`, "
    "greedy, block 8: NOT Kimi, only the shape of a curve",
    by_budget={1: 1.93, 2: 2.79, 4: 4.37, 8: 6.26, 16: 6.76, 32: 7.00, 64: 7.10})
ACCEPT_SOURCES = {s.name: s for s in (KIMI_DFLASH_CARD, TINY_MODEL)}


def load_measured(path, dev: Device = H200) -> dict:
    """A --measured JSON file -> {class: KernelClass} for the classes it has rows of (>= 2 byte counts each).

    Format: {"rows": [{"kernel_class", "bytes", "flops", "us"}]}; the FLOP term uses HAND_SPLIT's
    flop_efficiency of the class."""
    try:
        obj = json.loads(open(path).read())
    except (OSError, ValueError) as e:
        raise MeasuredRowsError(f"--measured {path}: cannot read it as JSON ({e})") from e
    rows = obj.get("rows") if isinstance(obj, dict) else None
    if not isinstance(rows, list) or not rows:
        raise MeasuredRowsError(f"--measured {path}: expected an object with a non-empty list 'rows'")
    by_class: dict[str, list] = {}
    for i, row in enumerate(rows):
        missing = [k for k in ("kernel_class", "bytes", "flops", "us") if not isinstance(row, dict) or k not in row]
        if missing:
            raise MeasuredRowsError(f"--measured {path}: rows[{i}] lacks {', '.join(missing)}")
        if row["kernel_class"] not in HAND_SPLIT:
            raise MeasuredRowsError(f"--measured {path}: rows[{i}].kernel_class {row['kernel_class']!r} is not "
                                    f"one of {', '.join(HAND_SPLIT)}")
        values = [row[k] for k in ("bytes", "flops", "us")]
        if not all(isinstance(v, (int, float)) and np.isfinite(v) and v >= 0 for v in values) or row["us"] <= 0:
            raise MeasuredRowsError(f"--measured {path}: rows[{i}] bytes, flops must be finite >= 0 and us > 0")
        by_class.setdefault(row["kernel_class"], []).append(values)
    return {name: fit_class(name, r, dev, HAND_SPLIT[name].flop_efficiency, f"fit of {len(r)} rows of {path}")
            for name, r in by_class.items()}


def load_hidden(path, budget: int | None = None) -> tuple[float, str]:
    """A bench step JSON measured with --collectives copy,pcie -> (the mean hidden fraction of its DDTree rows, at
    `budget` where it has rows of it, clamped to [0, 1], and a sentence naming the file and the rows)."""
    obj = json.loads(Path(path).read_text())
    rows = [r for r in obj.get("hidden", []) if r.get("budget") is not None]
    if not rows:
        raise InputError(f"{path}: no 'hidden' rows (measure them with ddtree bench step --collectives copy,pcie)")
    at = [r for r in rows if r["budget"] == budget] or rows
    f = sum(r["hidden_fraction"] for r in at) / len(at)
    what = ", ".join(f"budget {r['budget']} {r['routing']}: {r['hidden_fraction']:.3f}" for r in at)
    return min(max(f, 0.0), 1.0), f"{path} ({obj.get('device', '?')}; mean of {what})"
