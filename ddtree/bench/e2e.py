"""`ddtree bench e2e`: end-to-end tokens/s of plain autoregressive decoding and of DDTree per budget (issue 20).

One engine (default: the embedded tiny model's tp 1 engine, built into a temp dir), on the numpy
EngineExecutor (--device cpu) or one GPU (--device cuda: CudaExecutor, every step a captured CUDA graph).
For each mode, AR first, then DDTree at each budget:
    warm-up   one request (the first prompt) that is not timed: on cuda it loads the modules and captures
              the mode's graph, whose time is reported apart as capture_s
    timed     every prompt x --repeats requests; one request = prefill + max_new_tokens new tokens (EOS is
              not a stop, so every request makes the same count); a sample = new tokens / its wall time
A row gives tokens/s over the samples as mean ± sd (sample stddev), min and max, the same over the decode
alone (wall time after the prefill's first token), the mean acceptance length (committed tokens per step,
bonus included; the prefill's token is not a step), the steps of one pass over the prompts, and on cuda the
steps that replayed a graph vs those run eagerly (a step the graph cannot take: runtime/cuda_step.py), the
host time per graph step, and the speedup of each mode's mean tokens/s over AR's.

Lossless: every DDTree output is compared with the AR output of the same prompt. On the CPU (float64)
they must be identical and a difference fails the command; on the GPU the verify and the one-token decode
sum in different orders, so a row reports "identical" (near-ties are tests/runtime/test_cuda_step_gpu.py's).
Per-phase step time (draft / tree / verify / walk) needs separately captured phase graphs: not measured yet.

--prune auto (issue 53, runtime/pruning.py; --device cpu, or cuda at tp 1): each budget gets two DDTree rows, prune "off" then
"auto" (--prune-rate R: R tokens per expert byte every step, as `bench step --prune-rate`; default: the Pruner's own
rate, prune_rate_source says which). The pruned row carries pruned_nodes, pruned_per_step (mean),
distinct_experts_before / _after (mean a step and MoE layer) and accept_len_after (its own mean acceptance length);
its accept_len_before is the "off" row's, since the acceptance length the same run would have had unpruned is not
observable inside it. Issue 53's target metric, committed tokens per distinct expert read, on the pruned row:
    tokens_per_expert_before = accept_len_before / distinct_experts_before
    tokens_per_expert_after  = accept_len_after / distinct_experts_after
    tokens_per_expert_gain   = after / before - 1
    accept_len_change        = accept_len_after / accept_len_before - 1
"before" pairs the "off" row's acceptance length with the pruned run's unpruned routing estimate of the experts
(distinct_experts_before: every node's routing at every MoE layer, a dead row's from its own hidden state; what
the pruned run's trees would have read unpruned), not the "off" row's own expert counts, which are not measured.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from ddtree.bench.e2e_batch import print_concurrency_table, run_concurrency
from ddtree.bench.samples import LosslessError, spread
from ddtree.cli_types import FiniteFloatRange, comma_list
from ddtree.data import HELDOUT_PROMPTS, tiny_model_dirs
from ddtree.engine_dir.tuning import read_tuning, tuning_path
from ddtree.errors import reported
from ddtree.jsonout import emit_json
from ddtree.model.tokenizer import load_tokenizer
from ddtree.runtime.cuda_executor import CudaExecutor, gpu_unavailable
from ddtree.runtime.engine_executor import EngineExecutor
from ddtree.runtime.loop import RunStats, ar_steps, ddtree_steps
from ddtree.runtime.near_tie import first_difference
from ddtree.runtime.pruning import Pruner
from ddtree.runtime.step_profile import kernel_times, phase_times
from ddtree.training.corpus import load_prompts
from ddtree.tree.build import MAX_BUDGET
from ddtree.tree.sampling import SamplingParams

DEFAULTS = {"cpu": {"prompts": 1, "max_new_tokens": 16, "repeats": 1},      # numpy float64: slow, keep it small
            "cuda": {"prompts": 4, "max_new_tokens": 64, "repeats": 3}}
PHASES_NOTE = ("device us per DDTree step phase, each captured alone and replayed (median): draft, tree, verify, "
               "sample_walk, update; step = the whole step's graph; gaps = step - the phases' sum (cuda only)")


def parse_budgets(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16] (duplicates dropped); anything else is a BadParameter naming --budget."""
    return list(dict.fromkeys(comma_list(text, "--budget", int, 1, MAX_BUDGET)))


def heldout_texts(n: int) -> list[str]:
    """n prompts spread evenly over the committed held-out file (ddtree/data/heldout_prompts.jsonl)."""
    rows = load_prompts(HELDOUT_PROMPTS)
    if n > len(rows):
        raise click.BadParameter(f"{n} prompts asked for; the held-out file has {len(rows)}", param_hint="--prompts")
    return [rows[i * len(rows) // n]["text"] for i in range(n)]


def build_tiny_engine(out_dir: Path, log, device: str = "cuda") -> Path:
    """The embedded tiny model's tp 1 engine, built at out_dir/engine (kernels from the NVRTC cache; --device cpu
    reads no cubin, so it builds none)."""
    from ddtree.builder.build import build_engine  # onnx: the graphs extra
    log("building the embedded tiny model's tp 1 engine (a temp dir) ...")
    kernels = device == "cuda"
    return Path(build_engine(*tiny_model_dirs(), 1, ["sm_90"] if kernels else [], out_dir / "engine", graphs=False,
                             kernels=kernels)["engine"])


def open_executor(engine_dir: Path, device: str, gpu: int, max_context: int | None, kernel_plan: str = "fast"):
    if device == "cuda":
        return CudaExecutor(engine_dir, gpu=gpu, max_context=max_context, kernel_plan=kernel_plan)
    return EngineExecutor(engine_dir)


def one_request(ex, ids: list[int], budget: int | None, n_new: int, params: SamplingParams, prune=None) -> dict:
    """One request (budget None: AR) -> its tokens, RunStats and wall times (whole, and up to the first token).
    prune: None, or a function ex -> a fresh runtime/pruning.py Pruner (--prune auto)."""
    stats = RunStats()
    t0 = time.perf_counter()
    steps = (ar_steps(ex, ids, n_new, params, (), stats) if budget is None
             else ddtree_steps(ex, ids, n_new, params, budget, (), None, stats, prune and prune(ex)))
    tokens, first_s = [], None
    for chunk in steps:
        tokens += chunk
        if first_s is None:
            first_s = time.perf_counter() - t0
    return {"tokens": tokens, "stats": stats, "wall_s": time.perf_counter() - t0, "first_s": first_s}


def graph_counters(ex) -> dict | None:
    """The GPU steps' counters (capture seconds, graph steps, host seconds in them), or None on the CPU."""
    steps = ex.steps
    if steps is None:
        return None
    s = steps.stats()
    steady = s["graph_steps"] - s["started_steps"]                     # steps in flight when the loop asked
    return {"capture_s": s["capture_s"], "graph_steps": s["graph_steps"], "steady_steps": steady,
            "host_s": s["host_us_per_step"] * steady / 1e6,
            "started_host_s": s["host_us_per_started_step"] * s["started_steps"] / 1e6,
            "started_steps": s["started_steps"]}


def bench_mode(ex, prompt_ids: list[list[int]], budget: int | None, n_new: int, params: SamplingParams,
               repeats: int, prune=None) -> tuple[dict, list[list[int]]]:
    """One row (see the module docstring) and the outputs of its first timed pass, one per prompt."""
    before_warm = graph_counters(ex)
    one_request(ex, prompt_ids[0], budget, n_new, params, prune)                # warm-up: modules, capture
    before = graph_counters(ex)
    runs = [one_request(ex, ids, budget, n_new, params, prune) for _ in range(repeats) for ids in prompt_ids]
    after = graph_counters(ex)
    first_pass = runs[: len(prompt_ids)]
    steps = sum(r["stats"].steps for r in first_pass)
    committed = sum(sum(r["stats"].accept_lens) for r in first_pass)
    row = {"mode": "ar" if budget is None else "ddtree", "budget": budget,
           "tokens_per_s": spread([len(r["tokens"]) / r["wall_s"] for r in runs]),
           "decode_tokens_per_s": spread([(len(r["tokens"]) - 1) / max(r["wall_s"] - r["first_s"], 1e-9)
                                          for r in runs]),
           "prefill_s": statistics.fmean(r["first_s"] for r in runs),
           "mean_accept_len": committed / steps if steps else 0.0, "steps": steps,
           "new_tokens": sum(len(r["tokens"]) for r in first_pass), "samples": len(runs),
           "graph_steps": None, "eager_steps": None, "host_us_per_step": None, "host_us_per_started_step": None,
           "capture_s": None, "phases": None}
    if budget is not None and prune is not None:
        row.update(prune_stats([r["stats"].prune.to_dict() for r in first_pass]))
    if after is not None:
        graph_steps = after["graph_steps"] - before["graph_steps"]
        steady = after["steady_steps"] - before["steady_steps"]
        started = after["started_steps"] - before["started_steps"]
        row.update(graph_steps=graph_steps, eager_steps=sum(r["stats"].steps for r in runs) - graph_steps,
                   host_us_per_step=1e6 * (after["host_s"] - before["host_s"]) / steady if steady else None,
                   host_us_per_started_step=(1e6 * (after["started_host_s"] - before["started_host_s"]) / started
                                             if started else None),
                   capture_s=after["capture_s"] - before_warm["capture_s"])   # the warm-up's (and any later one)
        if budget is not None:                                  # device time per phase, captured alone
            row["phases"] = phase_times(ex.steps, budget, ex.drafter_config.block_size)
        else:                                                   # the AR graph against its kernels alone
            k = kernel_times(ex.steps)
            row["ar_kernels"] = {name: k[name] for name in ("step_us", "kernels_us", "kernels", "gaps_us", "ratio")}
    return row, [r["tokens"] for r in first_pass]


def prune_stats(per_request: list[dict]) -> dict:
    """A pruned row's counts over its first pass (per_request: PruneStats.to_dict() of each request)."""
    per_step = [n for d in per_request for n in d["pruned_per_step"]]
    return {"prune": "auto", "prune_rate_source": per_request[0]["prune_rate_source"],
            "pruned_nodes": sum(per_step), "pruned_per_step": statistics.fmean(per_step) if per_step else 0.0,
            "distinct_experts_before": statistics.fmean(d["distinct_experts_before"] for d in per_request),
            "distinct_experts_after": statistics.fmean(d["distinct_experts_after"] for d in per_request)}


def tokens_per_expert(row: dict) -> dict:
    """Issue 53's target metric of a pruned row (the module docstring): committed tokens per distinct expert read,
    before and after, and the relative changes. None where a denominator is 0."""
    def ratio(a, b):
        return a / b if a is not None and b else None
    before = ratio(row["accept_len_before"], row["distinct_experts_before"])
    after = ratio(row["accept_len_after"], row["distinct_experts_after"])
    gain = ratio(after, before)
    change = ratio(row["accept_len_after"], row["accept_len_before"])
    return {"tokens_per_expert_before": before, "tokens_per_expert_after": after,
            "tokens_per_expert_gain": None if gain is None else gain - 1,
            "accept_len_change": None if change is None else change - 1}


def check_lossless(ar_out: list[list[int]], dd_out: list[list[int]], budget: int) -> None:
    """CPU: DDTree's tokens must be AR's, prompt by prompt; else a LosslessError naming where they part."""
    for p, (ar, dd) in enumerate(zip(ar_out, dd_out)):
        if ar != dd:
            raise LosslessError(f"budget {budget}, prompt {p}: DDTree and AR differ at new token "
                                f"{first_difference(ar, dd)} "
                                "on the float64 CPU executor: losslessness broken")


def run_e2e(ex, prompt_ids, budgets, n_new: int, params: SamplingParams, repeats: int, device: str,
            log=lambda s: None, prune=None) -> list[dict]:
    """Every row, AR first; speedups over AR; identical (DDTree vs AR outputs) per DDTree row. prune (a function
    ex -> Pruner): each budget's row unpruned, then pruned (the module docstring)."""
    ar_row, ar_out = bench_mode(ex, prompt_ids, None, n_new, params, repeats)
    ar_row.update(speedup_vs_ar=1.0, identical=None, identical_prompts=None)
    log(f"ar: {ar_row['tokens_per_s']['mean']:.1f} tok/s")
    rows = [ar_row]
    for budget, pruner in [(b, p) for b in budgets for p in ((None, prune) if prune else (None,))]:
        row, out = bench_mode(ex, prompt_ids, budget, n_new, params, repeats, pruner)
        if pruner is not None:                  # the unpruned row of this budget is the one before
            row.update(accept_len_after=row["mean_accept_len"], accept_len_before=rows[-1]["mean_accept_len"])
            row.update(tokens_per_expert(row))
        elif prune is not None:
            row["prune"] = "off"
        same = sum(a == d for a, d in zip(ar_out, out))
        row.update(speedup_vs_ar=row["tokens_per_s"]["mean"] / ar_row["tokens_per_s"]["mean"],
                   identical=same == len(prompt_ids), identical_prompts=same)
        log(f"ddtree budget {budget}{' prune auto' if pruner else ''}: {row['tokens_per_s']['mean']:.1f} tok/s, "
            "mean acceptance length "
            f"{row['mean_accept_len']:.2f}, identical to AR {same}/{len(prompt_ids)}")
        rows.append(row)
        if device == "cpu":
            check_lossless(ar_out, out, budget)
    return rows


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def prune_cells(r: dict) -> list[str]:
    """A row's pruning columns: pruned nodes a step, distinct experts a MoE layer before / after, the relative
    changes of tokens per expert and of the acceptance length (percent); "-" on an unpruned row."""
    def pct(x):
        return "-" if x is None else f"{100 * x:+.1f} %"
    if r.get("prune") != "auto":
        return ["-"] * 4
    return [f"{r['pruned_per_step']:.2f}", f"{r['distinct_experts_before']:.2f} / {r['distinct_experts_after']:.2f}",
            pct(r["tokens_per_expert_gain"]), pct(r["accept_len_change"])]


def print_table(result: dict, console: Console) -> None:
    cuda = result["device"] != "cpu"
    table = Table(title=f"ddtree bench e2e: {result['device']}, {result['prompts']} prompts x "
                        f"{result['max_new_tokens']} new tokens x {result['repeats']} repeats, "
                        f"{result['sampling']['label']}")
    for name in ("mode", "budget", "t/s", "min", "max", "decode t/s", "accept len", "steps"):
        table.add_column(name, justify="right")
    if cuda:
        for name in ("graph/eager", "host us/step", "capture s"):
            table.add_column(name, justify="right")
    pruned = any(r.get("prune") == "auto" for r in result["rows"])
    if pruned:
        for name in ("pruned a step", "experts before / after", "tok/expert gain", "accept len change"):
            table.add_column(name, justify="right")
    table.add_column("speedup", justify="right")
    table.add_column("identical", justify="right")
    for r in result["rows"]:
        t, dt = r["tokens_per_s"], r["decode_tokens_per_s"]
        mode = r["mode"] + (" prune" if r.get("prune") == "auto" else "")
        cells = [mode, _fmt(r["budget"], "d"), f"{t['mean']:.1f} ± {t['sd']:.1f}", f"{t['min']:.1f}",
                 f"{t['max']:.1f}", f"{dt['mean']:.1f} ± {dt['sd']:.1f}", f"{r['mean_accept_len']:.2f}",
                 str(r["steps"])]
        if cuda:
            cells += [f"{r['graph_steps']}/{r['eager_steps']}", _fmt(r["host_us_per_step"], ".1f"),
                      _fmt(r["capture_s"], ".3f")]
        if pruned:
            cells += prune_cells(r)
        cells += [f"{r['speedup_vs_ar']:.2f}x", "-" if r["identical"] is None else str(r["identical"])]
        table.add_row(*cells)
    console.print(table)
    if result["memory"]:
        console.print("memory plan: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in result["memory"].items()))
    console.print(f"phases: {PHASES_NOTE}")
    for r in result["rows"]:
        if r.get("ar_kernels"):
            k = r["ar_kernels"]
            console.print(f"  AR step graph {k['step_us']:.1f} us vs its {k['kernels']} kernels alone {k['kernels_us']:.1f} "
                          f"us: ratio {k['ratio']:.2f}, launch gaps {k['gaps_us']:.1f} us")
        if r.get("phases"):
            console.print(f"  budget {r['budget']}: " + ", ".join(f"{k} {v:.1f}" for k, v in r["phases"].items()))


@click.command("e2e")
@click.option("--model", "engine_dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="engine dir from ddtree-build (tp 1 for --device cuda; default: the embedded tiny model's "
                   "tp 1 engine, built into a temp dir)")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="cpu: the numpy float64 EngineExecutor; cuda: one GPU, captured step graphs")
@click.option("--gpu", type=click.IntRange(min=0), default=0, show_default=True, help="--device cuda: the GPU index")
@click.option("--max-context", type=click.IntRange(min=1), default=None,
              help="--device cuda: cache rows allocated at load (default: the model's context, at most 4096)")
@click.option("--kernel-plan", type=click.Choice(["fast", "batch-invariant"]), default="fast", show_default=True,
              help="--device cuda: batch-invariant fixes every kernel's split for all row counts (DDTree == AR bitwise)")
@click.option("--prune", type=click.Choice(["off", "auto"]), default="off", show_default=True,
              help="auto: each budget also runs with the tree pruned inside the verify (issue 53), "
                   "beside its unpruned row")
@click.option("--prune-rate", type=FiniteFloatRange(min=0), default=None,
              help="--prune auto: tokens per expert byte, every step (default: the Pruner's own rate, the tuning "
                   "file's or tree/prune.py DEFAULT_RATE_PER_TOKEN x the tree's expected tokens)")
@click.option("--budget", "budgets", default="1,4,16,64", show_default=True,
              help=f"DDTree node budgets, comma-separated (1..{MAX_BUDGET})")
@click.option("--prompts", "n_prompts", type=click.IntRange(min=1), default=None,
              help="held-out prompts (default: 4 on cuda, 1 on cpu)")
@click.option("--max-new-tokens", type=click.IntRange(min=2), default=None,
              help="new tokens per request (default: 64 on cuda, 16 on cpu)")
@click.option("--repeats", type=click.IntRange(min=1), default=None,
              help="timed passes over the prompts (default: 3 on cuda, 1 on cpu)")
@click.option("--temperature", type=FiniteFloatRange(min=0.0), default=0.0, show_default=True, help="0 = greedy")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 = off")
@click.option("--top-p", type=FiniteFloatRange(min=0.0, min_open=True), default=1.0, show_default=True,
              help=">= 1 = off")
@click.option("--seed", type=click.IntRange(min=0, max=2**64 - 1), default=0, show_default=True)
@click.option("--concurrency", default=None,
              help="requests at once, comma-separated (e.g. 1,2,4,8): rows per mode and concurrency instead "
                   "(aggregate and per-request decode tok/s, time to first token; bench/e2e_batch.py); on --device "
                   "cuda c > 1 runs c request lanes, their steps one batched graph")
@click.option("--json", "as_json", is_flag=True, help="one JSON object on stdout")
@reported()
def e2e_command(engine_dir, device, gpu, max_context, kernel_plan, budgets, n_prompts, max_new_tokens, repeats, temperature,
                top_k, top_p, seed, concurrency, as_json, prune, prune_rate):
    """End-to-end tokens/s of AR and of DDTree per budget (mean ± sd over prompts x repeats)."""
    budget_list = parse_budgets(budgets)
    concurrencies = list(dict.fromkeys(comma_list(concurrency, "--concurrency", int, 1))) if concurrency else None
    if prune_rate is not None and prune != "auto":
        raise click.BadParameter("is the rate of --prune auto; add --prune auto or leave it out",
                                 param_hint="--prune-rate")
    if prune == "auto" and concurrencies:
        raise click.BadParameter("the batched runs do not prune: leave out --concurrency or use --prune off",
                                 param_hint="--prune")
    if device == "cpu" and kernel_plan != "fast":
        raise click.BadParameter(f"{kernel_plan} is a plan of the GPU kernels; --device cpu runs float64 numpy",
                                 param_hint="--kernel-plan")
    defaults = DEFAULTS[device]
    n_prompts = n_prompts or defaults["prompts"]
    n_new = max_new_tokens or defaults["max_new_tokens"]
    repeats = repeats or defaults["repeats"]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    texts = heldout_texts(n_prompts)
    if device == "cuda":
        why = gpu_unavailable(gpu)
        if why:
            raise click.ClickException(f"--device cuda is not available: {why}")
    log = lambda s: print(s, file=sys.stderr)                                        # noqa: E731
    with ExitStack() as stack:
        if engine_dir is None:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ddtree-e2e-")))
            engine, model = build_tiny_engine(tmp, log, device), "embedded tiny model (tp 1 engine built in a temp dir)"
        else:
            engine, model = Path(engine_dir), str(engine_dir)
        ex = open_executor(engine, device, gpu, max_context, kernel_plan)
        tok = load_tokenizer(ex.tokenizer_dir, ex.config)
        prompt_ids = [tok.encode(t) or [ex.config.bos_token_id] for t in texts]
        pruner = None
        if prune == "auto":
            tuning = read_tuning(engine) if tuning_path(engine).is_file() else None
            Pruner.for_executor(ex, tuning, prune_rate)    # refused by name before any run
            pruner = lambda e: Pruner.for_executor(e, tuning, prune_rate)           # noqa: E731
        t0 = time.perf_counter()
        if concurrencies:
            rows = run_concurrency(ex, tok, prompt_ids, budget_list, n_new, params, repeats, concurrencies, log,
                                   strict=device == "cpu" or kernel_plan == "batch-invariant")
        else:
            rows = run_e2e(ex, prompt_ids, budget_list, n_new, params, repeats, device, log, pruner)
        wall = time.perf_counter() - t0
    label = "greedy" if params.greedy else f"temperature {temperature}, top-k {top_k}, top-p {top_p}, seed {seed}"
    result = {"bench": "e2e", "device": ex.gpu.name if device == "cuda" else "cpu",
              "executor": ex.name, "model": model, "prompts": n_prompts,
              "kernel_plan": kernel_plan if device == "cuda" else None,
              "prompt_tokens": [len(ids) for ids in prompt_ids], "max_new_tokens": n_new, "repeats": repeats,
              "block_size": ex.drafter_config.block_size,
              "sampling": {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed, "label": label},
              "memory": dict(ex.memory_plan) if device == "cuda" else None, "concurrency": concurrencies,
              "prune_rate": prune_rate,
              "rows": rows, "ceiling": {"max_accept_len": ex.drafter_config.block_size},
              "notes": {"phases": PHASES_NOTE,
                        "tokens_per_s": "new tokens / the request's wall time, prefill included; decode_tokens_per_s"
                                        " from the prefill's first token on",
                        "capture_s": "graph capture during the warm-up request, excluded from the timed ones"},
              "wall_s": round(wall, 3)}
    if as_json:
        emit_json(result)
    if concurrencies:
        print_concurrency_table(result, Console(stderr=as_json, width=160))
    else:
        print_table(result, Console(stderr=as_json, width=160))

