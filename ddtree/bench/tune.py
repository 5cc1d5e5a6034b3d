"""`ddtree tune ENGINE_DIR`: measure this machine's DDTree step time per (budget, context bucket) and fit the
draft-probability calibration, into the engine's tuning.json (engine_dir/tuning.py), for `--budget auto`.

    ddtree tune ENGINE_DIR --device cuda --budget 1,2,4,8,16,32,64 --context 512,2048,8192

Step time (cuda): each budget's step graph captured by a short request, then replayed with the step state at
each context bucket (state set to start = bucket; the cache rows there are whatever the caches hold: the
time, not the tokens, is measured); median of --repeats replays. On the CPU (--device cpu, the numpy engine
executor) the mean wall time per step of one request per budget, at the prompt's context: every bucket gets it.
Calibration: the held-out prompts decoded at the largest budget, greedy, every tried edge's draft probability
against whether it was accepted (bench/calibration.py, tree/budget.py fit_calibration).
Expected distinct experts per budget: the uniform-routing expectation E (1 - (1 - k / E)^(budget + 1)) of the
engine's MoE layers (0 for a dense model), stated as such.
"""
from __future__ import annotations

import statistics
import time

import click

from ddtree.backends.meter import expected_distinct
from ddtree.bench.calibration import edge_samples, record_steps
from ddtree.bench.e2e import heldout_texts
from ddtree.cli_types import comma_list
from ddtree.engine_dir import check_engine, engine_configs
from ddtree.engine_dir.tuning import Tuning, now_utc, write_tuning
from ddtree.errors import reported
from ddtree.jsonout import emit_json
from ddtree.model.tokenizer import load_tokenizer
from ddtree.runtime.cuda_executor import CudaExecutor, gpu_unavailable
from ddtree.runtime.engine_executor import EngineExecutor
from ddtree.runtime.loop import RunStats, ddtree_steps, run_to_end
from ddtree.tree.budget import fit_calibration
from ddtree.tree.build import MAX_BUDGET
from ddtree.tree.sampling import SamplingParams

DEFAULT_BUDGETS = "1,2,4,8,16,32,64"


def parse_ints(text: str, flag: str) -> list[int]:
    return sorted(set(comma_list(text, flag, int, 1)))


def cuda_step_times(ex, prompt: list[int], budgets, contexts, repeats: int) -> list[list[float]]:
    steps, b = ex.steps, ex.drafter_config.block_size
    times = []
    for budget in budgets:
        run_to_end(ddtree_steps(ex, prompt, 2 * b, SamplingParams(), budget))      # captures the graph
        key = ("ddtree", budget, b, steps.plan.mode)
        if key not in steps.graphs:
            raise click.ClickException(f"budget {budget}: no step ran as a graph (prompt of {len(prompt)} tokens "
                                       f"shorter than the drafter block {b}?)")
        steps.drain()
        row = []
        for context in contexts:
            steps.state.set(start=context, bonus=1)
            steps.new_request()
            row.append(1e3 * statistics.median(ex.gpu.timed_ms(lambda: steps._replay(key), repeats)))
        times.append(row)
    steps.new_request()
    return times


def cpu_step_times(ex, prompt: list[int], budgets, contexts) -> list[list[float]]:
    times = []
    for budget in budgets:
        stats = RunStats()
        t0 = time.perf_counter()
        run_to_end(ddtree_steps(ex, prompt, 16, SamplingParams(), budget, stats=stats))
        per_step = (time.perf_counter() - t0) / max(stats.steps + 1, 1)              # the prefill counted as one
        times.append([1e6 * per_step] * len(contexts))
    return times


@click.command("tune")
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cuda", show_default=True)
@click.option("--gpu", "gpu_id", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--budget", "budgets", default=DEFAULT_BUDGETS, show_default=True)
@click.option("--context", "contexts", default="512,2048", show_default=True, help="context buckets (tokens)")
@click.option("--prompts", type=click.IntRange(min=2), default=6, show_default=True,
              help="held-out prompts for the calibration")
@click.option("--max-new-tokens", type=click.IntRange(min=8), default=64, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@reported()
def tune_command(engine_dir, device, gpu_id, budgets, contexts, prompts, max_new_tokens, repeats, as_json):
    """Measure ENGINE_DIR's step time per budget and context on this machine and fit the calibration
    (writes ENGINE_DIR/tuning.json for --budget auto)."""
    budgets, contexts = parse_ints(budgets, "--budget"), parse_ints(contexts, "--context")
    if budgets[-1] > MAX_BUDGET:
        raise click.BadParameter(f"budgets must be at most {MAX_BUDGET}", param_hint="--budget")
    meta, _ = check_engine(engine_dir, True)
    cfg, dcfg = engine_configs(engine_dir, meta)
    if contexts[-1] + budgets[-1] + 16 * dcfg.block_size > cfg.max_position_embeddings:
        raise click.BadParameter(f"context buckets up to {contexts[-1]} leave no room for the steps in the model's "
                                 f"{cfg.max_position_embeddings}-token context", param_hint="--context")
    if device == "cuda":
        why = gpu_unavailable(gpu_id)
        if why:
            raise click.ClickException(f"ddtree tune --device cuda: {why}")
        rows = min(cfg.max_position_embeddings, contexts[-1] + budgets[-1] + 16 * dcfg.block_size + repeats * 16)
        ex = CudaExecutor(engine_dir, gpu=gpu_id, max_context=rows)
        machine = ex.gpu.name
    else:
        ex, machine = EngineExecutor(engine_dir), "cpu"
    tok = load_tokenizer(ex.tokenizer_dir, cfg)
    prompt_ids = [tok.encode(t) for t in heldout_texts(prompts)]
    long_prompt = max(prompt_ids, key=len)
    per_prompt = record_steps(ex, prompt_ids, budgets[-1], max_new_tokens)
    p, acc, depth = edge_samples([s for steps in per_prompt for s in steps])
    calibration = fit_calibration(p, acc, depth)
    times = (cuda_step_times(ex, long_prompt, budgets, contexts, repeats) if device == "cuda"
             else cpu_step_times(ex, long_prompt, budgets, contexts))
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    experts = [expected_distinct(E, E, k, b + 1) if cfg.moe_layers else 0.0 for b in budgets]   # per MoE layer
    tuning = Tuning(machine, now_utc(), tuple(budgets), tuple(contexts), tuple(tuple(r) for r in times),
                    tuple(experts), calibration)
    path = write_tuning(engine_dir, tuning)
    result = {"tuning": str(path), "machine": machine, "budgets": budgets, "context_buckets": contexts,
              "step_time_us": times, "expected_distinct_experts": experts, "calibration_edges": int(len(p))}
    if as_json:
        emit_json(result)
        return
    click.echo(f"{path}: {machine}, calibration from {len(p)} tried edges")
    click.echo("budget  " + "  ".join(f"ctx {c:>6}" for c in contexts))
    for b, row in zip(budgets, times):
        click.echo(f"{b:>6}  " + "  ".join(f"{t:>8.1f} us" for t in row))
