"""Per-rank weight files of an engine, streamed from the checkpoint a few tensors at a time.

Every rank directory holds the same files with the same tensor names and shapes; the contents are
that rank's slice under the TP plan (builder/plan.py):
  rank<r>/embed.safetensors       model.embed_tokens.weight                      BF16 [V/tp, H]
  rank<r>/layer-LLL.safetensors   decoder layer L (below)
  rank<r>/head.safetensors        model.norm.weight [H], lm_head.weight          BF16 [V/tp, H]
  rank<r>/drafter.safetensors     drafter.<DFlash name>, e.g. drafter.fc.weight  BF16 [H, K H/tp]
Names are stable and are the graphs' input names. A tensor that is a slice (or a copy) of one
checkpoint tensor keeps that tensor's canonical name (docs/kimi-k2.md section 3; drafter tensors get the
prefix `drafter.`), dtype (BF16 as stored, the router bias F32) and the rank's shape, e.g.
  model.layers.L.self_attn.q_b_proj.weight     [N/tp (Dn + Dr), Q]   heads r N/tp ..
  model.layers.L.self_attn.kv_b_proj.weight    [N/tp (Dn + Dv), R]
  model.layers.L.self_attn.o_proj.weight       [H, N/tp Dv]
  model.layers.L.self_attn.q_a_proj.weight     [Q, H]                replicated (so are norms, kv_a, router)
The routed experts of a layer are stacked over the rank's experts in the MoE kernel layout of
plugins/layout.py (gate and up fused; words int32, scales bf16); the trailing dims are whatever
layout.repack_expert returns for one [I_r, H] expert (today: words [2 I_r/32, H/64, 2, 32, 4]):
  model.layers.L.mlp.experts.gate_up.words     I32  [E_r, *layout of the fused gate/up [2 I_r, H]]
  model.layers.L.mlp.experts.gate_up.scales    BF16 [E_r, *its scales]
  model.layers.L.mlp.experts.down.words        I32  [E_r, *layout of down [H, I_r]]
  model.layers.L.mlp.experts.down.scales       BF16 [E_r, *its scales]
with (E_r, I_r) = (E, I/tp) for experts="tp" and (E/tp, I) for "ep" (rank r: experts r E/tp ..).
Experts are sliced and repacked by builder/experts.py (each read once for all ranks).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ddtree.builder.experts import ExpertRepacker, expert_specs
from ddtree.builder.plan import ROWS, TPPlan
from ddtree.builder.tensor_io import RankFileWriter, TensorReader, header_bytes
from ddtree.engine_dir import rank_dir
from ddtree.model.tensors import TensorSpec, drafter_tensor_specs, expert_name, target_tensor_specs

BLOCK_BYTES = 32 << 20              # row blocks read from the checkpoint at a time
DRAFTER_PREFIX = "drafter."
Progress = Callable[[int], None]    # called with the checkpoint bytes just consumed


@dataclass(frozen=True)
class Dense:
    """One rank tensor that is a slice (or copy) of one checkpoint tensor."""
    name: str                       # name in the rank file
    source: str                     # canonical name in the target or drafter checkpoint
    drafter: bool
    axis: int | None                # split axis (None: replicated)
    spec: TensorSpec                # the rank's shape
    source_bytes: int


@dataclass(frozen=True)
class Experts:
    """The routed experts of one MoE layer, stacked in the kernel layout."""
    layer: int
    specs: dict                     # rank tensor name -> TensorSpec (the four stacked tensors)
    source_bytes: int


def rank_spec(spec: TensorSpec, axis: int | None, tp: int) -> TensorSpec:
    if axis is None:
        return spec
    shape = list(spec.shape)
    shape[axis] //= tp
    return TensorSpec(spec.dtype, tuple(shape))


def _target_file(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "embed.safetensors"
    if name.startswith("model.layers."):
        return f"layer-{int(name.split('.')[2]):03d}.safetensors"
    return "head.safetensors"


def file_plan(plan: TPPlan) -> list[tuple[str, list]]:
    """[(file name, [Dense | Experts in file order])] for one rank (every rank has the same)."""
    tspecs = target_tensor_specs(plan.cfg)
    expert_bytes: dict[int, int] = {}                  # layer -> checkpoint bytes of its routed experts
    for name, spec in tspecs.items():
        if ".mlp.experts." in name:
            layer = int(name.split(".")[2])
            expert_bytes[layer] = expert_bytes.get(layer, 0) + spec.nbytes
    files: dict[str, list] = {}
    for name, spec in tspecs.items():
        fname = _target_file(name)
        if ".mlp.experts." in name:
            layer = int(name.split(".")[2])
            if name == f"{expert_name(layer, 0, 'gate_proj')}.weight_packed":    # the stack goes here
                files.setdefault(fname, []).append(Experts(layer, expert_specs(plan, layer), expert_bytes[layer]))
            continue
        axis = plan.target_split(name)
        files.setdefault(fname, []).append(Dense(name, name, False, axis, rank_spec(spec, axis, plan.tp), spec.nbytes))
    entries = []
    for name, spec in drafter_tensor_specs(plan.dcfg).items():
        axis = plan.drafter_split(name)
        entries.append(Dense(DRAFTER_PREFIX + name, name, True, axis, rank_spec(spec, axis, plan.tp), spec.nbytes))
    files["drafter.safetensors"] = entries
    layers = sorted(f for f in files if f.startswith("layer-"))
    order = ["embed.safetensors", *layers, "head.safetensors", "drafter.safetensors"]
    return [(f, files[f]) for f in order]


def file_specs(entries: list) -> dict[str, TensorSpec]:
    specs = {}
    for e in entries:
        specs.update(e.specs if isinstance(e, Experts) else {e.name: e.spec})
    return specs


def rank_tensor_specs(plan: TPPlan) -> dict[str, TensorSpec]:
    """Every tensor of one rank (name -> TensorSpec), from the plan alone: what the meter counts."""
    return {name: spec for _, entries in file_plan(plan) for name, spec in file_specs(entries).items()}


def rank_bytes(plan: TPPlan) -> int:
    """Bytes of one rank directory's weight files (headers included)."""
    total = 0
    for _, entries in file_plan(plan):
        specs = file_specs(entries)
        total += len(header_bytes(specs, {"format": "pt"})[0]) + 64 + sum(s.nbytes for s in specs.values())
    return total


def source_bytes(plan: TPPlan) -> int:
    return sum(e.source_bytes for _, entries in file_plan(plan) for e in entries)


# ----------------------------------------------------------------------------------------------
# streaming

def _stream_dense(e: Dense, reader: TensorReader, writers: list[RankFileWriter], progress: Progress) -> None:
    src = reader.spec(e.source)
    n = src.shape[0]
    step = max(1, BLOCK_BYTES // max(src.nbytes // n, 1)) if len(src.shape) > 1 else n
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        block = reader.rows(e.source, r0, r1)                            # [rows, ...] as stored
        for r, w in enumerate(writers):
            if e.axis is None:
                w.write(e.name, r0, block)
            elif e.axis == ROWS:
                a, b = r * e.spec.shape[0], (r + 1) * e.spec.shape[0]      # this rank's rows of the tensor
                lo, hi = max(a, r0), min(b, r1)
                if lo < hi:
                    w.write(e.name, lo - a, block[lo - r0: hi - r0])
            else:
                c = e.spec.shape[1]
                w.write(e.name, r0, block[:, r * c: (r + 1) * c])
        progress(block.nbytes)


def write_rank_weights(plan: TPPlan, ckpt, dckpt, out_dir, progress: Progress | None = None,
                       on_file: Callable[[str], None] | None = None, jobs: int = 1) -> list[str]:
    """Write every rank's rank<r>/*.safetensors under out_dir; returns the file names (per rank).
    `jobs` > 1 repacks the routed experts in that many worker processes (builder/experts.py)."""
    progress = progress or (lambda n: None)
    readers = {False: TensorReader(ckpt), True: TensorReader(dckpt)}
    repacker = ExpertRepacker(plan, ckpt, readers[False], jobs)
    names = []
    try:
        for fname, entries in file_plan(plan):
            specs = file_specs(entries)
            writers = [RankFileWriter(rank_dir(out_dir, r) / fname, specs,
                                      {"ddtree_rank": str(r), "ddtree_tp": str(plan.tp)}) for r in range(plan.tp)]
            try:
                for e in entries:
                    if isinstance(e, Experts):
                        repacker.write_layer(e.layer, writers, progress)
                    else:
                        _stream_dense(e, readers[e.drafter], writers, progress)
                for w in writers:
                    w.close()
            except BaseException:
                for w in writers:
                    w.abort()
                raise
            names.append(fname)
            if on_file:
                on_file(fname)
    finally:
        repacker.close()
        for rd in readers.values():
            rd.close()
    return names
