"""Train the embedded tiny model: `python -m ddtree.training.train --out ddtree/data/tiny --seed 0`.

Phases (all on CPU, torch.set_num_threads(2), bf16 autocast for the matmuls):
  1. target   next-byte cross-entropy on the pinned stdlib corpus (residual dropout 0.1, training
              only: it is not part of the architecture); the router's correction bias
              follows the aux-loss-free rule (bias += rate * sign(mean load - load) after each
              step); the last `qat_frac` of the steps train the routed experts through INT4
              group-32 fake quantisation (straight-through), so the exported grid loses nothing.
  2. export   target/ in the K2.6 layout (INT4 experts, BF16, F32 bias), then read back.
  3. data     corpus prompts + the exported target's greedy continuations, and its taps.
  4. drafter  the DFlash objective: random anchors in the generated part, block =
              [anchor, MASK x (b-1)], context strictly before the anchor, cross-entropy on block
              positions 1..b-1 weighted exp(-(k-1)/gamma); the target's embedding and lm_head are frozen.
  5. export   drafter/; training_log.json with the settings and losses.
Every random choice derives from --seed.
"""
from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning: on a shared 2-core machine spinning threads of two
# processes starve each other (a training step measured 2x slower). Must precede the torch import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import math
import resource
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ddtree.model.config import DrafterConfig, KimiConfig, QuantConfig, RopeConfig
from ddtree.model.presets import BYTE_BOS, BYTE_EOS, BYTE_MASK, BYTE_PAD
from ddtree.training.corpus import load_corpus
from ddtree.training.drafter_model import DFlashDrafter
from ddtree.training.export import export_drafter, export_target, load_drafter, load_target
from ddtree.training.generate import drafter_sequences
from ddtree.training.target_model import KimiForCausalLM, init_weights

ROPE = RopeConfig(theta=10000.0, type="yarn", factor=4.0, original_max_position_embeddings=512,
                  beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


def embedded_configs(attention_factor: float = 1.0, block_size: int = 8) -> tuple[KimiConfig, DrafterConfig]:
    """The shipped model: Kimi K2 structure at byte scale (dense layer 0, 3 MoE layers of 8 experts,
    top-2 + 1 shared, MLA nope/rope split, YaRN); tp = 4 divisibility of docs/interfaces.md 2 kept.
    max_position_embeddings 896 is the context the shipped model was measured to still work at
    (`python -m ddtree.training.evaluate --context-curve`; it trained on 512-byte windows), not the
    2048 its YaRN factor 4 x 512 would suggest: a retrained model should be measured again."""
    target = KimiConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, q_lora_rank=64,
                        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                        vocab_size=512, intermediate_size=512, moe_intermediate_size=512,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                        first_k_dense_replace=1, rope=ROPE, quant=QuantConfig(group_size=32),
                        max_position_embeddings=896, bos_token_id=BYTE_BOS, eos_token_ids=(BYTE_EOS,),
                        pad_token_id=BYTE_PAD, tokenizer="bytes")
    drafter = DrafterConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=3,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=512,
                            block_size=block_size, target_layer_ids=(0, 1, 2), mask_token_id=BYTE_MASK,
                            rope=ROPE, rms_norm_eps=1e-5, num_target_layers=4,
                            attention_factor=attention_factor)
    return target, drafter


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine down to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(steps - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(model, lr: float, weight_decay: float):
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim == 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim != 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), fused=True)


def windows(stream: np.ndarray, starts: np.ndarray, length: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([stream[s: s + length] for s in starts]))


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) over ids [B, S]."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = model(ids[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def train_target(cfg: KimiConfig, corpus, args, rng: np.random.Generator, log) -> tuple[KimiForCausalLM, list]:
    torch.manual_seed(args.seed)
    model = KimiForCausalLM(cfg)
    init_weights(model, args.seed)
    model.dropout = args.dropout
    opt = make_optimizer(model, args.lr, 0.1)
    S, steps = args.seq_len + 1, args.target_steps
    val_starts = np.random.default_rng(args.seed + 7).integers(0, len(corpus.heldout) - S, size=16)
    val_ids = windows(corpus.heldout, val_starts, S)
    history, t0 = [], time.time()
    qat_from = int(steps * (1 - args.qat_frac))
    for step in range(steps):
        model.train()
        if step == qat_from:
            model.set_expert_quant(cfg.quant.group_size)
            log(f"step {step}: routed experts now train through INT4 group-{cfg.quant.group_size} fake quantisation")
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, args.lr, args.warmup)
        ids = windows(corpus.train, rng.integers(0, len(corpus.train) - S, size=args.batch), S)
        loss = lm_loss(model, ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        for moe in model.moe_layers():
            moe.update_bias(args.bias_rate)
        if step % args.eval_every == 0 or step == steps - 1:
            model.eval()
            with torch.no_grad():
                val = lm_loss(model, val_ids).item()
            loads = [round(float(m.load.max() / m.load.mean()), 2) for m in model.moe_layers()]
            history.append({"step": step, "train_nats": round(loss.item(), 4), "heldout_nats": round(val, 4)})
            log(f"target step {step:5d}  loss {loss.item():.3f}  held-out {val:.3f} nats = "
                f"{val / math.log(2):.3f} bits/byte  max/mean expert load {loads}  {time.time() - t0:.0f}s")
    model.set_expert_quant(0)
    return model, history


@torch.no_grad()
def target_taps(target: KimiForCausalLM, seqs: np.ndarray, taps: tuple, batch: int = 16) -> torch.Tensor:
    """seqs [n, S] -> concatenated tap outputs [n, S, K*H] in bf16 (float32 forward)."""
    target.eval()
    out = []
    for i in range(0, len(seqs), batch):
        _, tapped = target(torch.from_numpy(seqs[i: i + batch]), taps=taps)
        out.append(torch.cat([tapped[L] for L in taps], dim=-1).to(torch.bfloat16))
    return torch.cat(out)


def train_drafter(dcfg: DrafterConfig, target: KimiForCausalLM, seqs: np.ndarray, plens: np.ndarray,
                  taps: torch.Tensor, args, rng: np.random.Generator, log) -> tuple[DFlashDrafter, list]:
    torch.manual_seed(args.seed + 1)
    drafter = DFlashDrafter(dcfg)
    init_weights(drafter, args.seed + 1)
    opt = make_optimizer(drafter, args.drafter_lr, 0.1)
    embed = target.model.embed_tokens.weight.detach()                   # [V, H] frozen
    lm_head = target.lm_head.weight.detach()                            # [V, H] frozen
    b, A, steps = dcfg.block_size, args.anchors, args.drafter_steps
    depth_w = torch.exp(-torch.arange(b - 1, dtype=torch.float32) / args.gamma)   # [b-1] exp(-(k-1)/gamma)
    seqs_t = torch.from_numpy(seqs)
    S = seqs.shape[1]
    history, t0 = [], time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, args.drafter_lr, args.warmup)
        rows = rng.integers(0, len(seqs), size=args.drafter_batch)
        # anchors: last prompt byte or any generated byte with b-1 generated bytes after it
        anchors = np.stack([np.sort(rng.choice(np.arange(plens[r] - 1, S - b + 1), size=A, replace=False))
                            for r in rows])
        anchors_t = torch.from_numpy(anchors)                                         # [B, A]
        ids = seqs_t[rows]                                                            # [B, S]
        offsets = anchors_t[..., None] + torch.arange(b)                              # [B, A, b]
        block = torch.full_like(offsets, dcfg.mask_token_id)
        block[..., 0] = torch.gather(ids, 1, anchors_t)                               # [anchor, MASK...]
        labels = torch.gather(ids, 1, offsets.reshape(len(rows), -1)).reshape(offsets.shape)[..., 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = drafter(taps[rows].float(), embed[block], anchors_t)             # [B, A, b, H]
            logits = hidden[:, :, 1:] @ lm_head.T                                     # [B, A, b-1, V]
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                             reduction="none").reshape(labels.shape)                  # [B, A, b-1]
        loss = (ce * depth_w).sum(-1).mean() / depth_w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        if step % args.eval_every == 0 or step == steps - 1:
            with torch.no_grad():
                hit = (logits.argmax(-1) == labels).float().mean(dim=(0, 1))           # [b-1] top-1 per depth
            history.append({"step": step, "loss": round(loss.item(), 4),
                            "top1_per_depth": [round(x, 3) for x in hit.tolist()]})
            log(f"drafter step {step:5d}  loss {loss.item():.3f}  top-1 per depth "
                f"{' '.join(f'{x:.2f}' for x in hit.tolist())}  {time.time() - t0:.0f}s")
    return drafter, history


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output dir: OUT/target and OUT/drafter are (re)written")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--target-steps", type=int, default=800)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--dropout", type=float, default=0.1, help="target residual dropout (training only)")
    p.add_argument("--qat-frac", type=float, default=0.2, help="last fraction of target steps with INT4 fake quant")
    p.add_argument("--bias-rate", type=float, default=3e-3, help="aux-loss-free correction-bias update speed")
    p.add_argument("--gen-seqs", type=int, default=1024, help="greedy continuations for the drafter")
    p.add_argument("--gen-batch", type=int, default=128)
    p.add_argument("--prompt-min", type=int, default=32)
    p.add_argument("--prompt-max", type=int, default=320)
    p.add_argument("--drafter-steps", type=int, default=600)
    p.add_argument("--drafter-batch", type=int, default=16)
    p.add_argument("--drafter-lr", type=float, default=2e-3)
    p.add_argument("--anchors", type=int, default=32, help="anchors per sequence per step")
    p.add_argument("--gamma", type=float, default=5.0, help="depth weight exp(-(k-1)/gamma)")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--attention-factor", type=float, default=1.0, help="drafter ddtree_attention_factor")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--skip-target", action="store_true", help="reuse OUT/target, train the drafter only")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_lines = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_lines.append(msg)

    t_start = time.time()
    rng = np.random.default_rng(args.seed)
    cfg, dcfg = embedded_configs(args.attention_factor, args.block_size)
    corpus = load_corpus()
    log(f"corpus: {len(corpus.train)} training tokens, {len(corpus.heldout)} held out, "
        f"{len(corpus.skipped)} pinned files skipped")
    given = sys.argv[1:] if argv is None else argv
    report = {"command": "python -m ddtree.training.train " + " ".join(given), "args": vars(args)}
    if args.skip_target:
        previous = out / "training_log.json"
        report["target"] = json.loads(previous.read_text()).get("target") if previous.exists() else None
    else:
        model, hist = train_target(cfg, corpus, args, rng, log)
        if (out / "target").exists():
            shutil.rmtree(out / "target")
        export_target(model, out / "target")
        report["target"] = {"history": hist, "wall_s": round(time.time() - t_start, 1)}
        log(f"target exported to {out / 'target'} ({time.time() - t_start:.0f}s)")
    target = load_target(out / "target")                                # exactly the shipped values
    t_data = time.time()
    seqs, plens = drafter_sequences(target, corpus.train, args.gen_seqs, args.seq_len,
                                    (args.prompt_min, args.prompt_max), args.gen_batch, rng, log)
    taps = target_taps(target, seqs, dcfg.target_layer_ids)
    log(f"drafter data: {len(seqs)} sequences with taps ({time.time() - t_data:.0f}s)")
    drafter, dhist = train_drafter(dcfg, target, seqs, plens, taps, args, rng, log)
    if (out / "drafter").exists():
        shutil.rmtree(out / "drafter")
    export_drafter(drafter, out / "drafter")
    load_drafter(out / "drafter")                                        # the files read back
    report["drafter"] = {"history": dhist}
    report["wall_s"] = round(time.time() - t_start, 1)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    report["cpu_s"] = round(usage.ru_utime + usage.ru_stime, 1)       # core-seconds, contention-free
    (out / "training_log.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"done in {report['wall_s']:.0f}s wall, {report['cpu_s']:.0f} CPU-s: {out / 'target'}, {out / 'drafter'}")
    return report


if __name__ == "__main__":
    main()
