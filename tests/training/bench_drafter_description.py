"""A DFlash training step (forward + backward, bf16 autocast) on the tiny drafter, random weights and taps: the
training module (ddtree/training/drafter_model.py: all A blocks of a sequence at once, block j masked to the
context before its anchor) against the one description on the torch backend (the op contract has one context
length per call, so per sequence A calls, the context cache growing to each anchor: the same loss, checked).
The measurement behind drafter_model.py's docstring:

    PYTHONPATH=. python3 tests/training/bench_drafter_description.py BATCH ANCHORS REPEATS [THREADS]
    PYTHONPATH=. python3 tests/training/bench_drafter_description.py 16 32 2        # train.py's defaults
"""
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")      # as train.py: idle OpenMP threads sleep on a shared CPU

import numpy as np
import torch
import torch.nn.functional as F

from ddtree.backends import torch_backend as tb
from ddtree.training.drafter_model import DFlashDrafter
from ddtree.training.target_model import KimiForCausalLM, init_weights
from ddtree.training.train import embedded_configs

torch.set_num_threads(int(sys.argv[4]) if len(sys.argv) > 4 else 2)
B, A, S = int(sys.argv[1]), int(sys.argv[2]), 512
cfg, dcfg = embedded_configs()
target = KimiForCausalLM(cfg); init_weights(target, 0)
drafter = DFlashDrafter(dcfg); init_weights(drafter, 1)
b, K, H = dcfg.block_size, dcfg.num_taps, dcfg.hidden_size
rng = np.random.default_rng(0)
taps = torch.randn(B, S, K * H)
ids = torch.randint(0, 256, (B, S))
anchors = torch.from_numpy(np.stack([np.sort(rng.choice(np.arange(40, S - b + 1), A, replace=False))
                                     for _ in range(B)]))
offsets = anchors[..., None] + torch.arange(b)
block = torch.full_like(offsets, dcfg.mask_token_id); block[..., 0] = torch.gather(ids, 1, anchors)
labels = torch.gather(ids, 1, offsets.reshape(B, -1)).reshape(offsets.shape)[..., 1:]
embed, lm_head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()

def module_logits():
    hidden = drafter(taps, embed[block], anchors)
    return hidden[:, :, 1:] @ lm_head.T                                   # [B, A, b-1, V]

def description_logits():
    weights = {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head,
               **{f"drafter.{n}": p for n, p in drafter.named_parameters()}}
    ops = tb.TorchOps(weights, tb.tp1_layout(cfg, dcfg))
    out = []
    for s in range(B):
        ck = [torch.zeros(1, S, dcfg.num_key_value_heads, dcfg.head_dim) for _ in range(dcfg.num_hidden_layers)]
        cv = [torch.zeros(1, S, dcfg.num_key_value_heads, dcfg.head_dim) for _ in range(dcfg.num_hidden_layers)]
        T, rows = 0, []
        for j in range(A):
            a = int(anchors[s, j])
            rows.append(tb.drafter_forward(ops, cfg, dcfg, block[s, j][None], torch.arange(a, a + b, dtype=torch.int32),
                                           taps[s, T:a][None], ck, cv, torch.tensor([T], dtype=torch.int32))[0])
            T = a
        out.append(torch.stack(rows))
    return torch.stack(out)                                                # [B, A, b-1, V]

def step(fn):
    t = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = fn()
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
    drafter.zero_grad(set_to_none=True)
    loss.backward()
    return time.perf_counter() - t, loss.item()

for fn in (module_logits, description_logits):
    step(fn)
res = {}
for rep in range(int(sys.argv[3])):
    for fn in (module_logits, description_logits):
        res.setdefault(fn.__name__, []).append(step(fn))
losses = [v[0][1] for v in res.values()]
assert abs(losses[0] - losses[1]) < 1e-3, f"the two forms disagree: losses {losses}"
for k, v in res.items():
    ts = sorted(t for t, _ in v)
    print(f"{k:20s} step {[round(t, 2) for t in ts]} s, loss {v[0][1]:.4f}; "
          f"best {B * A * (b - 1) / ts[0]:.0f} predicted tokens/s")
