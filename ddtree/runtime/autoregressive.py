"""Plain autoregressive generation over the numpy reference: the lossless baseline DDTree must equal.

A convenience over `loop.ar_steps` (the one AR loop, written over executor primitives) for code
that holds a `Target`. Token i of the output sits at absolute position len(prompt) + i and is drawn
with the sampling definition of docs/interfaces.md section 5 at that position, so DDTree with the same
seed commits the same tokens. Stops after an EOS id (kept in the output) or max_new_tokens.
From the shell: `ddtree-run --mode ar --model DIR/target --drafter DIR/drafter "prompt"`.
"""
from __future__ import annotations

from ddtree.reference.model import Target
from ddtree.runtime.executor import NumpyExecutor
from ddtree.runtime.loop import RunStats, ar_steps, run_to_end
from ddtree.tree.sampling import SamplingParams


def generate_ar(target: Target, prompt_ids, max_new_tokens: int, params: SamplingParams = SamplingParams(),
                eos_ids=()) -> tuple[list[int], dict]:
    """Returns (new tokens, stats) with stats in the shape of docs/interfaces.md section 1."""
    stats = RunStats()
    tokens = run_to_end(ar_steps(NumpyExecutor(target), prompt_ids, max_new_tokens, params, eos_ids, stats))
    return tokens, stats.to_dict()
