"""Plain autoregressive generation over the numpy reference: the lossless baseline DDTree must equal.

One prefill forward over the prompt, then one token per step. Token i of the output sits at
absolute position len(prompt) + i and is drawn with the sampling definition of
interfaces.md section 5 at that position, so DDTree with the same seed commits the same tokens.
Generation stops after an EOS id (kept in the output) or max_new_tokens.

    python -m ddtree.runtime.autoregressive CHECKPOINT_DIR --prompt "Hello" --max-new-tokens 8 [--json]
"""
from __future__ import annotations

import json
import sys
import time

import click
import numpy as np

from ddtree.model.tokenizer import load_tokenizer
from ddtree.reference.model import Target, causal_visible
from ddtree.tree.sampling import SamplingParams, sample


def generate_ar(target: Target, prompt_ids, max_new_tokens: int, params: SamplingParams = SamplingParams(),
                eos_ids=()) -> tuple[list[int], dict]:
    """Returns (new tokens, stats) with stats in the shape of interfaces.md section 1 (one token per step)."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("generate_ar: the prompt is empty (at least one token, e.g. BOS, is needed)")
    if max_new_tokens < 0:
        raise ValueError(f"generate_ar: max_new_tokens must be >= 0, got {max_new_tokens}")
    eos = {int(e) for e in eos_ids}
    start = time.perf_counter()
    tokens: list[int] = []
    steps = 0
    if max_new_tokens > 0:
        cache = target.new_cache(capacity=len(prompt) + max_new_tokens)
        ids = np.asarray(prompt, dtype=np.int64)
        pos = np.arange(len(prompt))
        while True:
            logits, _ = target.forward(ids, pos, causal_visible(cache.length, len(ids)), cache)
            steps += 1
            next_pos = int(pos[-1]) + 1                                      # where the new token will sit
            token = int(sample(logits[-1:], np.array([next_pos]), params)[0])
            tokens.append(token)
            if token in eos or len(tokens) >= max_new_tokens:
                break
            ids, pos = np.array([token]), np.array([next_pos])
    wall = time.perf_counter() - start
    stats = {"new_tokens": len(tokens), "steps": steps, "mean_accept_len": 1.0 if steps else 0.0,
             "per_depth_accept_rate": [], "tokens_per_s": len(tokens) / wall if wall > 0 else 0.0,
             "wall_s": wall}
    return tokens, stats


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.option("--prompt", default="Hello", show_default=True, help="Prompt text ([BOS] is put in front).")
@click.option("--prompt-ids", default=None, help="Comma-separated token ids instead of --prompt.")
@click.option("--max-new-tokens", default=16, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int)
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def main(checkpoint, prompt, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, as_json):
    """Generate tokens from CHECKPOINT with the float64 numpy reference (plain autoregressive)."""
    target = Target.from_checkpoint(checkpoint)
    tokenizer = load_tokenizer(checkpoint, target.config)
    if prompt_ids is not None:
        ids = [int(x) for x in prompt_ids.split(",") if x.strip()]
    else:
        ids = [tokenizer.bos_id] + tokenizer.encode(prompt)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    eos_ids = set(target.config.eos_token_ids) | set(tokenizer.stop_ids)
    tokens, stats = generate_ar(target, ids, max_new_tokens, params, sorted(eos_ids))
    text = tokenizer.decode(tokens)
    click.echo(f"{len(tokens)} tokens in {stats['wall_s']:.2f} s ({stats['tokens_per_s']:.1f} tok/s)", err=True)
    if as_json:
        json.dump({"text": text, "tokens": tokens, "stats": stats}, sys.stdout)
        sys.stdout.write("\n")
    else:
        click.echo(f"tokens: {tokens}")
        click.echo(f"text:   {text!r}")


if __name__ == "__main__":
    main()
