"""`ddtree bench e2e --concurrency 1,2,4,8`: several requests at once (runtime/batch.py), per mode and concurrency.

For each mode (AR, then DDTree at each budget) and each concurrency c, the requests (--prompts x --repeats, at
least c, a multiple of the prompts: request i is prompt i % P) all arrive at once and run through one BatchDecoder of c sequences (a request
joins when a slot frees, FIFO). A row:
    aggregate_tokens_per_s         every new token / the wall time from the arrival to the last request's end
    aggregate_decode_tokens_per_s  the tokens after each request's first / the wall time from the first
                                   request's first token to the last request's end
    decode_tokens_per_s            per request: (tokens - 1) / (its end - its first token), mean ± sd, min, max
    ttft_s                         per request: arrival -> its first token (queue wait + prefill), mean ± sd, ...
    identical                      every request's tokens equal its own at the first concurrency (on the CPU
                                   and under --kernel-plan batch-invariant a difference fails the command:
                                   LosslessError; the GPU's fast plan counts them: identical_requests)
On the CPU the sequences interleave one step each per round (float64 numpy: a second request's rows cost as
much as the first's), so the aggregate rate stays about that of concurrency 1 while each request's rate drops by
c. On the GPU (--device cuda) concurrency c > 1 runs the requests on c request lanes and their DDTree steps as one
batched graph (runtime/cuda_step_batch.py); each concurrency is run once untimed first, so the graphs of the
lane sets it meets are captured before the timed run.
"""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ddtree.bench.samples import LosslessError, spread
from ddtree.runtime.batch import run_batch
from ddtree.runtime.engine import DDTreeEngine
from ddtree.runtime.near_tie import first_difference
from ddtree.runtime.request import GenerationRequest
from ddtree.tree.sampling import SamplingParams


def concurrency_row(engine, prompt_ids, budget: int | None, n_new: int, params: SamplingParams, c: int,
                    repeats: int) -> tuple[dict, list[list[int]]]:
    """One row at concurrency c and every request's tokens (request order)."""
    P = len(prompt_ids)
    n_requests = -(-max(c, P * repeats) // P) * P          # a multiple of the prompts: request i is prompt i % P
    request = GenerationRequest(max_new_tokens=n_new, temperature=params.temperature, top_k=params.top_k,
                                top_p=params.top_p, seed=params.seed, budget=budget or 1,
                                mode="ar" if budget is None else "ddtree", ignore_eos=True)
    jobs = [(i, prompt_ids[i % len(prompt_ids)], request) for i in range(n_requests)]
    out = run_batch(engine, jobs, c)
    recs = [out[i] for i in range(n_requests)]
    end = max(r["end_s"] for r in recs)
    first = min(r["first_s"] for r in recs)
    tokens = [len(r["tokens"]) for r in recs]
    row = {"mode": "ar" if budget is None else "ddtree", "budget": budget, "concurrency": c,
           "requests": n_requests, "new_tokens": sum(tokens), "wall_s": end,
           "aggregate_tokens_per_s": sum(tokens) / end,
           "aggregate_decode_tokens_per_s": sum(t - 1 for t in tokens) / max(end - first, 1e-9),
           "decode_tokens_per_s": spread([(len(r["tokens"]) - 1) / max(r["end_s"] - r["first_s"], 1e-9)
                                          for r in recs]),
           "ttft_s": spread([r["first_s"] for r in recs]),
           "steps": sum(r["stats"].steps for r in recs),
           "mean_accept_len": (sum(sum(r["stats"].accept_lens) for r in recs)
                               / max(sum(r["stats"].steps for r in recs), 1))}
    return row, [r["tokens"] for r in recs]


def run_concurrency(ex, tokenizer, prompt_ids, budgets, n_new: int, params: SamplingParams, repeats: int,
                    concurrencies: list[int], log=lambda s: None, strict: bool = True) -> list[dict]:
    """Every row, AR first then each budget, each at every concurrency; with `strict` (the CPU's float64, the
    GPU's batch-invariant plan) a request whose tokens differ from its own at the first concurrency listed raises
    LosslessError, else the row counts them. On the GPU each concurrency is warmed up (captured) untimed first."""
    engine = DDTreeEngine(ex, tokenizer, None, None)
    rows = []
    for budget in [None, *budgets]:
        concurrency_row(engine, prompt_ids[:1], budget, n_new, params, 1, 1)          # warm-up, not timed
        base = None
        for c in concurrencies:
            if ex.lane_pool is not None and c > 1:    # the lane sets' batched graphs captured, not timed
                concurrency_row(engine, prompt_ids, budget, n_new, params, c, 1)
            row, outs = concurrency_row(engine, prompt_ids, budget, n_new, params, c, repeats)
            if base is None:
                base = outs
            same = [out == base[i % len(base)] for i, out in enumerate(outs)]   # the same prompt i % P and seed
            row["identical"], row["identical_requests"] = all(same), sum(same)
            label = "ar" if budget is None else f"ddtree budget {budget}"
            log(f"{label}, concurrency {c}: aggregate {row['aggregate_tokens_per_s']:.1f} tok/s, per request "
                f"{row['decode_tokens_per_s']['mean']:.1f} decode tok/s, ttft {row['ttft_s']['mean'] * 1e3:.1f} ms")
            if strict and not row["identical"]:
                i = same.index(False)
                raise LosslessError(f"{label}, concurrency {c}: request {i} differs from itself at concurrency "
                                    f"{concurrencies[0]} at new token {first_difference(base[i % len(base)], outs[i])}")
            rows.append(row)
    return rows


def print_concurrency_table(result: dict, console: Console) -> None:
    table = Table(title=f"ddtree bench e2e --concurrency: {result['device']}, {result['max_new_tokens']} new tokens "
                        f"per request, {result['sampling']['label']}")
    for name in ("mode", "budget", "conc.", "requests", "aggregate t/s", "aggregate decode t/s",
                 "per-request decode t/s", "ttft ms", "accept len", "identical"):
        table.add_column(name, justify="right")
    for r in result["rows"]:
        d, t = r["decode_tokens_per_s"], r["ttft_s"]
        table.add_row(r["mode"], "-" if r["budget"] is None else str(r["budget"]), str(r["concurrency"]),
                      str(r["requests"]), f"{r['aggregate_tokens_per_s']:.1f}",
                      f"{r['aggregate_decode_tokens_per_s']:.1f}", f"{d['mean']:.1f} ± {d['sd']:.1f}",
                      f"{t['mean'] * 1e3:.1f} ± {t['sd'] * 1e3:.1f}", f"{r['mean_accept_len']:.2f}",
                      str(r["identical"]))
    console.print(table)
