"""`ddtree-run`: generate text with DDTree speculative decoding (docs/interfaces.md section 1).

Text streams to stdout as tokens commit and one summary line goes to stderr; with --json the
result is one JSON object on stdout (human text on stderr). --mode both runs DDTree then plain
autoregressive decoding with the same seed and reports whether they are identical.
"""
from __future__ import annotations

import codecs
import sys

import click

from ddtree.cli_types import (
    MAX_PROMPT_BYTES,
    SAMPLING_DEFAULTS,
    FiniteFloatRange,
    QuietCommand,
    check_prompt_argument,
    decode_prompt,
    read_prompt_bytes,
)
from ddtree.errors import reported
from ddtree.jsonout import emit_json
from ddtree.parallel.shm_group import RankError
from ddtree.runtime.engine import DDTreeEngine
from ddtree.runtime.loop import RunStats
from ddtree.runtime.near_tie import classify_departure, describe, first_difference
from ddtree.tree.build import MAX_BUDGET
from ddtree.tree.sampling import SamplingParams


def _read_prompt(prompt, prompt_file) -> str:
    if prompt is not None and prompt_file is not None:
        raise click.UsageError("give the prompt either as an argument or with --prompt-file, not both")
    if prompt_file is not None:            # bytes, decoded strictly: a bad byte is named with its file and offset
        name = getattr(prompt_file, "name", None)
        is_file = isinstance(name, str) and name not in ("-", "<stdin>")
        source = name if is_file else "<stdin>"
        return decode_prompt(read_prompt_bytes(prompt_file, source), source, universal_newlines=is_file)
    if prompt is not None:
        return check_prompt_argument(prompt)
    if sys.stdin is None or sys.stdin.isatty():
        raise click.UsageError("no prompt: pass PROMPT, --prompt-file FILE, or pipe text on stdin")
    binary = getattr(sys.stdin, "buffer", None)        # None: stdin replaced by a text-only stream (embedding)
    if binary is None:
        return sys.stdin.read(MAX_PROMPT_BYTES)
    return decode_prompt(read_prompt_bytes(binary, "<stdin>"), "<stdin>")


CHAT_TEMPLATE_TOKENS = 256          # a chat template's own tokens around one user turn, at most


def default_max_context(text: str, max_new_tokens: int, budget: int, chat: bool) -> int:
    """--device cuda's KV rows (docs/interfaces.md 8): prompt + max new tokens + budget + 1, rounded up to 256.
    The prompt's tokens are bounded by its UTF-8 bytes (a byte-level BPE never makes more tokens than bytes),
    plus the chat template's; the executor caps the result at the model's context."""
    rows = len(text.encode()) + (CHAT_TEMPLATE_TOKENS if chat else 1) + max_new_tokens + budget + 1
    return -(-rows // 256) * 256


class BudgetParam(click.ParamType):
    """--budget: an integer in 1..MAX_BUDGET, or 'auto' (chosen per step from the engine's tuning file)."""
    name = "budget"

    def convert(self, value, param, ctx):
        if value == "auto" or isinstance(value, int):
            return value
        try:
            b = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is neither an integer in 1..{MAX_BUDGET} nor 'auto'", param, ctx)
        if not 1 <= b <= MAX_BUDGET:
            self.fail(f"{b} is not in the range 1..{MAX_BUDGET} (or 'auto')", param, ctx)
        return b


class GpuIndices(click.ParamType):
    """--gpu: one GPU index (an int), or comma-separated indices, one per rank (a list)."""
    name = "gpu"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, list)):
            return value
        try:
            gpus = [int(x) for x in str(value).split(",")]
        except ValueError:
            self.fail(f"{value!r} is not a GPU index or a comma-separated list of them (e.g. 0 or 0,1)", param, ctx)
        if min(gpus) < 0:
            self.fail(f"{value!r}: GPU indices are >= 0", param, ctx)
        return gpus[0] if len(gpus) == 1 else gpus


def _summary(stats: dict, label: str) -> str:
    return (f"{label}: {stats['new_tokens']} new tokens, {stats['steps']} steps, mean acceptance length "
            f"{stats['mean_accept_len']:.2f}, {stats['tokens_per_s']:.1f} tok/s ({stats['wall_s']:.2f} s), "
            f"finish reason {stats['finish_reason']}")


@click.command("run", cls=QuietCommand, context_settings={"help_option_names": ["-h", "--help"]},
               epilog=SAMPLING_DEFAULTS)
@click.argument("prompt", required=False)
@click.option("--prompt-file", type=click.File("rb"), default=None,
              help="Read the prompt from a file ('-' = stdin), UTF-8.")
@click.option("--model", "model_dir", default=None,
              help="Target checkpoint dir, engine dir from ddtree-build, or a Hugging Face Hub id owner/name[@rev] "
                   "(downloaded to, or offline read from, the Hub cache). Default: the embedded tiny model.")
@click.option("--drafter", "drafter_dir", default=None,
              help="DFlash drafter dir or Hub id (default: the embedded tiny drafter; none with an engine dir).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--temperature", type=FiniteFloatRange(min=0.0), default=0.0, show_default=True,
              help="0 = greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 = off.")
@click.option("--top-p", type=FiniteFloatRange(min=0.0, min_open=True), default=1.0, show_default=True,
              help=">= 1 = off.")
@click.option("--seed", type=click.IntRange(min=0, max=2**64 - 1), default=0, show_default=True)
@click.option("--budget", type=BudgetParam(), default="16", show_default=True,
              help="Drafted tree nodes per step (root excluded).")
@click.option("--prune", type=click.Choice(["off", "auto"]), default="off", show_default=True,
              help="auto: drop unlikely tree nodes whose experts no other node shares, inside the verify (issue 53; "
                   "lossless; --device cpu with an engine dir, or --device cuda at tp 1). --json stats: pruned_nodes, pruned_per_step, "
                   "distinct_experts_before/after.")
@click.option("--block-size", type=click.IntRange(min=2), default=None,
              help="Drafter block size (default: the drafter's; depth = block size - 1).")
@click.option("--mode", type=click.Choice(["ddtree", "ar", "both"]), default="ddtree", show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda", "tensorrt"]), default="cpu", show_default=True,
              help="cuda: one GPU; a tp 1 engine dir (--model), or checkpoint dirs repacked into one at load. "
                   "tensorrt: an engine dir's TensorRT-RTX plans (ddtree-build --trt), on a GPU of their compute "
                   "capability (12.0) only.")
@click.option("--gpu", type=GpuIndices(), default="0", show_default=True,
              help="--device cuda: the GPU index; a tp N engine: N indices, one per rank process (e.g. 0,1; 0,0 puts "
                   "both ranks on GPU 0), or one index g for GPUs g..g+N-1.")
@click.option("--max-context", type=click.IntRange(min=1), default=None,
              help="--device cuda: cache rows allocated at load (default: the prompt's bytes + max new tokens + "
                   "budget + 1, rounded up to 256, at most the model's context).")
@click.option("--kernel-plan", type=click.Choice(["fast", "batch-invariant"]), default="fast", show_default=True,
              help="--device cuda: batch-invariant fixes every kernel's split for all row counts, so DDTree commits "
                   "AR's tokens bitwise (slower).")
@click.option("--allreduce", type=click.Choice(["one-shot", "two-shot", "nccl", "auto"]), default="one-shot",
              show_default=True,
              help="--device cuda with a tp N engine: the rank processes' all-reduce. one-shot: peer to peer over "
                   "CUDA IPC; two-shot: reduce-scatter + all-gather over the same buffer; nccl: NCCL (one GPU per "
                   "rank); auto: the cheapest per message by the PCIe model (one-shot, two-shot, NCCL; no NCCL where "
                   "ranks share a GPU).")
@click.option("--chat", is_flag=True, help="Wrap the prompt as one user turn in the model's chat template.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
@click.option("--skip-verify", is_flag=True,
              help="Engine dir: skip the sha256 of every file (the sizes and config checks still run).")
@click.option("--ranks", type=click.Choice(["processes", "threads"]), default="processes", show_default=True,
              help="Engine dir with tp > 1: one process per rank (rank 0 is this one), or every rank as a thread "
                   "of this process.")
@reported()
def run_command(prompt, prompt_file, model_dir, drafter_dir, max_new_tokens, temperature, top_k, top_p, seed,
                budget, prune, block_size, mode, device, gpu, max_context, kernel_plan, allreduce, chat, as_json,
                skip_verify, ranks):
    """Generate text for PROMPT with DDTree speculative decoding."""
    text = _read_prompt(prompt, prompt_file)
    cap = device == "cuda" and max_context is None
    if cap:
        max_context = default_max_context(text, max_new_tokens, MAX_BUDGET if budget == "auto" else budget, chat)
    try:
        with DDTreeEngine.load(model_dir, drafter_dir, device, verify=not skip_verify, ranks=ranks, gpu=gpu,
                               max_context=max_context, cap_context=cap, kernel_plan=kernel_plan,
                               allreduce=allreduce) as engine:
            if mode != "ar":
                engine.pruner(prune)                # --prune auto refused by name before any token
            _generate(engine, text, max_new_tokens, temperature, top_k, top_p, seed, budget, block_size, mode, chat,
                      as_json, prune)
    except RankError as e:                   # a rank died, froze or failed: named, every rank stopped
        raise click.ClickException(f"{type(e).__name__}: {e}") from e


def _generate(engine, text, max_new_tokens, temperature, top_k, top_p, seed, budget, block_size, mode, chat,
              as_json, prune="off"):
    dmax = engine.drafter_config.block_size
    if block_size is not None and block_size > dmax:
        raise click.BadParameter(f"{block_size} is above the drafter's block_size {dmax}", param_hint="--block-size")
    request = [{"role": "user", "content": text}] if chat else text
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
              budget=budget, block_size=block_size)
    out = sys.stderr if as_json else sys.stdout
    first = "ar" if mode == "ar" else "ddtree"
    stats = RunStats()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    tokens = []
    try:
        for chunk in engine.stream(request, mode=first, stats=stats, prune=prune, **kw):
            tokens += chunk
            shown = [t for t in chunk if t not in engine.stop_ids]
            out.write(decoder.decode(engine.tokenizer.decode_bytes(shown)))
            out.flush()
    except Exception:
        if tokens:                          # the partial text ends its line: an error is a line of its own
            _end_line(out)
        raise
    out.write(decoder.decode(b"", final=True) + "\n")
    result = {"text": engine.decode(tokens), "tokens": tokens, "stats": stats.to_dict()}
    click.echo(_summary(result["stats"], first), err=True)
    if mode == "both":
        ar = engine.generate(request, mode="ar", **kw)
        result["ar"] = ar.stats
        result["identical"] = ar.tokens == tokens
        speedup = result["stats"]["tokens_per_s"] / max(ar.stats["tokens_per_s"], 1e-12)
        click.echo(_summary(ar.stats, "ar"), err=True)
        click.echo(f"identical: {result['identical']}, speedup {speedup:.2f}x", err=True)
        if engine.device == "cuda":
            result["stats"]["near_ties"] = _near_ties(engine, request, ar.tokens, tokens, kw, result["stats"])
    result["stats"].update(engine.device_stats())
    if as_json:
        emit_json(result)
    if mode == "both" and not result["identical"] and not result["stats"].get("near_ties"):
        raise click.ClickException(f"DDTree and AR outputs differ at new token {first_difference(tokens, ar.tokens)}: "
                                   "losslessness broken")


def _end_line(out) -> None:
    try:
        out.write("\n")
        out.flush()
    except (OSError, ValueError):             # the stream itself failed: nothing to end
        pass


def _near_ties(engine, request, ar_tokens, dd_tokens, kw, stats) -> int:
    """GPU --mode both: 1 if the first departure of DDTree from AR is a near-tie under the derived rule
    (runtime/near_tie.py: AR's and DDTree's tokens there can swap between the decode and verify paths, their
    logits measured on this prompt at the row counts the run verified), 0 if the runs agree; a departure that is
    no near-tie is an error (losslessness broken) raised by the caller."""
    if ar_tokens == dd_tokens:
        return 0
    if engine.processes is not None:             # the test replays the AR path on rank 0's executor alone
        raise click.ClickException(
            f"DDTree and AR differ at new token {first_difference(ar_tokens, dd_tokens)}; the near-tie test replays "
            "the path on one executor and does not run on rank processes: run the tp 1 engine with --mode both, or "
            "compare against the float64 reference (tests/runtime/test_cuda_rank_processes_gpu.py)")
    ids = engine.encode(request)
    block = kw["block_size"] or engine.drafter_config.block_size
    budgets = [int(b) for b in stats.get("budget_per_step", {})] if kw["budget"] == "auto" else [kw["budget"]]
    rows = tuple(sorted({block, *(b + 1 for b in budgets or [MAX_BUDGET])}))
    params = SamplingParams(temperature=kw["temperature"], top_k=kw["top_k"], top_p=kw["top_p"], seed=kw["seed"])
    v = classify_departure(engine.executor, ids, ar_tokens, dd_tokens, params, rows)
    click.echo(describe(v), err=True)
    return int(v["near_tie"])
