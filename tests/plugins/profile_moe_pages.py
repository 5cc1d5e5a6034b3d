"""Do the routed experts slow down when the experts they pick from span many layers, and does touching every page of
the layer first take it back? (issue 48, fourteenth session). In the step's AR timeline the routed gate_up ends
17-18 us after the router on the H100 whether the shared expert runs beside it or not, against ~8 alone in `ddtree
bench moe`, which picks from one layer's experts (1.06 GB at tp 8); the step's 61 layers span 65 GB, and an
expert's 1.84 MB gate_up sits somewhere in its layer's 706 MB: a page whose address translation no recent access
made (plugins/prefetch.py PageTouch).

One GPU: `PYTHONPATH=. python3 tests/plugins/profile_moe_pages.py [LAYERS] > OUT.json`. R launches of one M = 1
MoE (the given routing's alignment + gate_up + down, as `ddtree bench moe`), each with its own random top-8, in one
graph; launch i reads layer i % L's experts, for L = 1 .. LAYERS. Then each launch behind a touch of its layer's
pages (one load every 2 MiB, and every 64 KiB), and the touches alone: `touched - touch_alone` is the MoE with its
translations made. Words and scales are left as allocated (garbage timing-wise is as good as random: no value is
checked here)."""
import json
import sys

import numpy as np

from ddtree.bench.kernels import EXPERTS, HIDDEN, TOPK, moe_weight_shapes, open_gpu, time_graph
from ddtree.plugins import randfill
from ddtree.plugins.moe import FusedMoE, MoEShape
from ddtree.plugins.prefetch import PAGE, PageTouch

LAYERS = int(sys.argv[1]) if len(sys.argv) > 1 else 60
R = 120                                 # launches a graph: every L below divides into it at least twice
gpu, ceiling = open_gpu()
shape = MoEShape(HIDDEN, 256, EXPERTS, TOPK, scaling=2.827, max_tokens=8)
layers = []
for _ in range(LAYERS):
    w = {k: gpu.alloc(s, dt) for k, (s, dt) in moe_weight_shapes(EXPERTS, HIDDEN, 256).items()}
    for key in ("gate_up_scale", "down_scale"):          # the scales finite (the words: any bits are INT4 values)
        randfill.fill_device(gpu, w[key], len(layers), randfill.SCALES_BF16)
    layers.append(w)
moes = [FusedMoE(gpu, shape, w) for w in layers]
x, out = gpu.alloc((8, HIDDEN), np.uint16), gpu.alloc((8, HIDDEN), np.uint16)
randfill.fill_device(gpu, x, 99, randfill.ACT_BF16)
rng = np.random.default_rng(0)
routes = [(gpu.upload(rng.permutation(EXPERTS)[:TOPK].astype(np.int32)[None]),
           gpu.upload(np.full((1, TOPK), 2.827 / TOPK, np.float32))) for _ in range(R)]
touches = {"2MiB": PageTouch(gpu, PAGE), "64KiB": PageTouch(gpu, 64 << 10)}


def pages(i: int) -> list:
    return [(a.ptr, a.nbytes) for a in layers[i].values()]


moes[0].run(x, out, 1, topk=routes[0])                   # compile and set the shared-memory limits outside capture
for t in touches.values():
    t.run(pages(0))
gpu.sync()


def per_launch(body) -> float:
    return round(time_graph(gpu, lambda st: [body(i, st) for i in range(R)]) * 1e3 / R, 2)


rows = []
for L in sorted({n for n in (1, 2, 4, 8, 16, 30, LAYERS) if n <= LAYERS}):
    row = {"layers": L, "moe_us": per_launch(lambda i, st: moes[i % L].run(x, out, 1, topk=routes[i], stream=st))}
    for name, t in touches.items():
        alone = per_launch(lambda i, st: t.run(pages(i % L), stream=st))
        both = per_launch(lambda i, st: (t.run(pages(i % L), stream=st),
                                         moes[i % L].run(x, out, 1, topk=routes[i], stream=st)))
        row[f"touch_{name}_alone_us"], row[f"touched_{name}_us"] = alone, both
        row[f"moe_after_touch_{name}_us"] = round(both - alone, 2)
    rows.append(row)
    print(row, file=sys.stderr)
print(json.dumps({"device": gpu.name, "copy_gbps": round(ceiling["gbps"]), "launches": R, "M": 1, "tp": 8,
                  "layer_gb": round(sum(a.nbytes for a in layers[0].values()) / 1e9, 3), "rows": rows}, indent=1))
