"""`ddtree bench accept`: DDTree acceptance length vs node budget on the held-out prompts.

For every prompt of the committed held-out file (ddtree/data/heldout_prompts.jsonl), greedy, on
the numpy float64 reference (NumpyExecutor): one plain autoregressive run, then one DDTree run
per budget. A row per budget reports the mean acceptance length (tokens committed per DDTree
step, the bonus token included; ceiling = block_size), the per-depth acceptance rates and
whether every prompt's DDTree output equals its AR output. The AR generations also give the
repetition check: the fraction of distinct 8-grams (1.0 = nothing repeats; a loop -> near 0).

Defaults: the embedded tiny model (`ddtree.data.tiny_model_dirs()`).
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

import click
import numpy as np

from ddtree.cli_types import FiniteFloatRange, comma_list
from ddtree.data import HELDOUT_PROMPTS, tiny_model_dirs
from ddtree.errors import reported
from ddtree.jsonout import emit_json
from ddtree.model.tokenizer import load_tokenizer
from ddtree.reference.drafter import Drafter
from ddtree.reference.model import Target
from ddtree.runtime.executor import NumpyExecutor
from ddtree.runtime.loop import RunStats, ar_steps, ddtree_steps, run_to_end
from ddtree.training.corpus import load_prompts
from ddtree.tree.sampling import SamplingParams

BUDGETS = (1, 2, 4, 8, 16, 32, 64)


def distinct_ngram_fraction(tokens, n: int = 8) -> float:
    """Distinct n-grams / all n-grams of a token list; 1.0 when shorter than n."""
    grams = [tuple(tokens[i: i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def load_models(target_dir, drafter_dir, attention_factor: float | None = None) -> NumpyExecutor:
    target = Target.from_checkpoint(Path(target_dir))
    drafter = Drafter.from_checkpoint(Path(drafter_dir), target)
    if attention_factor is not None:                     # measure a factor other than the trained one
        drafter.config = replace(drafter.config, attention_factor=attention_factor)
    return NumpyExecutor(target, drafter)


def run_accept(ex: NumpyExecutor, prompt_ids: list[list[int]], budgets, max_new_tokens: int,
               eos_ids=(), block_size: int | None = None, log=lambda s: None) -> dict:
    """The bench without the CLI: {"rows": [...], "generation": {...}} (see the module docstring)."""
    params = SamplingParams()
    ar_out, ar_wall = [], 0.0
    for ids in prompt_ids:
        stats = RunStats()
        ar_out.append(run_to_end(ar_steps(ex, ids, max_new_tokens, params, eos_ids, stats)))
        ar_wall += stats.wall_s
    distinct = [distinct_ngram_fraction(t) for t in ar_out]
    rows = []
    for budget in budgets:
        total = RunStats()
        identical = 0
        for ids, ar in zip(prompt_ids, ar_out):
            stats = RunStats()
            out = run_to_end(ddtree_steps(ex, ids, max_new_tokens, params, budget, eos_ids, block_size, stats))
            identical += out == ar
            total.steps += stats.steps
            total.new_tokens += stats.new_tokens
            total.accept_lens += stats.accept_lens
            total.wall_s += stats.wall_s
            total.max_depth = stats.max_depth
        d = total.to_dict()
        rows.append({"budget": budget, "mean_accept_len": round(d["mean_accept_len"], 4),
                     "per_depth_accept_rate": [round(x, 4) for x in d["per_depth_accept_rate"]],
                     "steps": d["steps"], "new_tokens": d["new_tokens"],
                     "identical_to_ar": identical == len(prompt_ids), "identical_prompts": identical,
                     "tokens_per_s": round(d["tokens_per_s"], 2), "wall_s": round(d["wall_s"], 3)})
        log(f"budget {budget:3d}: mean acceptance length {d['mean_accept_len']:.3f}  "
            f"identical to AR {identical}/{len(prompt_ids)}")
    n_ar = sum(len(t) for t in ar_out)
    generation = {"prompts": len(prompt_ids), "max_new_tokens": max_new_tokens, "ar_new_tokens": n_ar,
                  "ar_tokens_per_s": round(n_ar / ar_wall, 2) if ar_wall else 0.0,
                  "distinct_8gram_fraction_mean": round(float(np.mean(distinct)), 4),
                  "distinct_8gram_fraction_min": round(float(np.min(distinct)), 4)}
    return {"rows": rows, "generation": generation, "ar_outputs": ar_out}


@click.command("accept")
@click.option("--model", "target_dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="target checkpoint dir (default: the embedded tiny model)")
@click.option("--drafter", "drafter_dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="DFlash drafter dir (default: the embedded tiny drafter)")
@click.option("--budget", "budgets", default=",".join(map(str, BUDGETS)), show_default=True,
              help="comma-separated node budgets (1..255)")
@click.option("--max-new-tokens", type=click.IntRange(1), default=128, show_default=True)
@click.option("--prompt-file", "prompts_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="JSON-lines prompt file with a 'text' per line (default: the committed held-out prompts)")
@click.option("--prompts", "num_prompts", type=click.IntRange(1), default=None,
              help="use only the first N prompts")
@click.option("--block-size", type=click.IntRange(2), default=None, help="draft block (<= the drafter's)")
@click.option("--attention-factor", type=FiniteFloatRange(min=0.0, min_open=True), default=None,
              help="override the drafter's ddtree_attention_factor (to measure it)")
@click.option("--json", "as_json", is_flag=True, help="one JSON object on stdout")
@reported()
def accept(target_dir, drafter_dir, budgets, max_new_tokens, prompts_path, num_prompts, block_size,
           attention_factor, as_json):
    """Acceptance length vs budget on held-out prompts (greedy, numpy reference)."""
    budget_list = comma_list(budgets, "--budget", int, 1, 255)
    if (target_dir is None) != (drafter_dir is None):
        raise click.UsageError("give both --model and --drafter, or neither (the embedded tiny model)")
    if target_dir is None:
        target_dir, drafter_dir = tiny_model_dirs()
    try:
        prompts = load_prompts(Path(prompts_path) if prompts_path else HELDOUT_PROMPTS)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--prompt-file")
    prompts = prompts[:num_prompts] if num_prompts else prompts
    ex = load_models(target_dir, drafter_dir, attention_factor)
    dcfg = ex.drafter_config
    if block_size is not None and block_size > dcfg.block_size:
        raise click.BadParameter(f"{block_size} exceeds the drafter's block_size {dcfg.block_size}",
                                 param_hint="--block-size")
    tok = load_tokenizer(target_dir, ex.config)
    prompt_ids = [tok.encode(p["text"], allow_special=False) for p in prompts]
    log = (lambda s: print(s, file=sys.stderr)) if as_json else click.echo
    t0 = time.perf_counter()
    result = run_accept(ex, prompt_ids, budget_list, max_new_tokens, ex.config.eos_token_ids, block_size, log)
    b = block_size or dcfg.block_size
    obj = {"bench": "accept", "device": "cpu (numpy float64 reference)", "rows": result["rows"],
           "ceiling": {"max_accept_len": b},
           "generation": result["generation"],
           "config": {"target": str(target_dir), "drafter": str(drafter_dir), "block_size": b,
                      "attention_factor": dcfg.attention_factor, "greedy": True},
           "wall_s": round(time.perf_counter() - t0, 2)}
    if as_json:
        emit_json(obj)
        return
    g = result["generation"]
    click.echo(f"{g['prompts']} prompts x {max_new_tokens} new tokens; AR distinct 8-gram fraction "
               f"{g['distinct_8gram_fraction_mean']:.3f} (min {g['distinct_8gram_fraction_min']:.3f})")
    click.echo(f"{'budget':>6}  {'accept len':>10}  {'identical':>9}  per-depth acceptance")
    for r in result["rows"]:
        click.echo(f"{r['budget']:>6}  {r['mean_accept_len']:>10.3f}  {str(r['identical_to_ar']):>9}  "
                   + " ".join(f"{x:.2f}" for x in r["per_depth_accept_rate"]))
