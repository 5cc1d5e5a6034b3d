"""Plain AR generation against a from-scratch recomputation (no cache reuse) at every step."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from ddtree.cli import main
from ddtree.model.synthetic import synth
from ddtree.model.tokenizer import ByteTokenizer
from ddtree.reference.model import Target, causal_visible
from ddtree.runtime.autoregressive import generate_ar
from ddtree.tree.sampling import SamplingParams, sample

PROMPT = [256, 100, 101, 102, 32, 102, 105, 98]        # BOS "def fib"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = synth(tmp_path_factory.mktemp("ar"), "tiny", seed=3)[0]
    return path, Target.from_checkpoint(path)


def recompute_each_step(target, prompt, n, params):
    """Every step: a fresh cache and a full forward over everything so far; sample the last row."""
    seq = list(prompt)
    for _ in range(n):
        logits, _ = target.forward(np.array(seq), np.arange(len(seq)), causal_visible(0, len(seq)),
                                   target.new_cache())
        seq.append(int(sample(logits[-1:], np.array([len(seq)]), params)[0]))
    return seq[len(prompt):]


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95, seed=11),
                                    SamplingParams(temperature=1.5, top_k=20, seed=2 ** 40 + 3)])
def test_generate_ar_equals_full_recomputation(tiny, params):
    _, target = tiny
    tokens, stats = generate_ar(target, PROMPT, 10, params, eos_ids=())
    assert tokens == recompute_each_step(target, PROMPT, 10, params)
    assert stats["new_tokens"] == 10 and stats["steps"] == 9          # the prefill is not a step
    assert stats["mean_accept_len"] == 1.0


def test_sampled_runs_differ_by_seed_and_repeat_by_seed(tiny):
    _, target = tiny
    a, _ = generate_ar(target, PROMPT, 12, SamplingParams(temperature=1.0, seed=1))
    b, _ = generate_ar(target, PROMPT, 12, SamplingParams(temperature=1.0, seed=1))
    c, _ = generate_ar(target, PROMPT, 12, SamplingParams(temperature=1.0, seed=2))
    assert a == b and a != c


def test_stops_after_eos_and_keeps_it(tiny):
    _, target = tiny
    full, _ = generate_ar(target, PROMPT, 8, SamplingParams())
    eos = full[3]
    first = full.index(eos)
    stopped, stats = generate_ar(target, PROMPT, 8, SamplingParams(), eos_ids=(eos,))
    assert stopped == full[: first + 1]
    assert stats["new_tokens"] == first + 1
    assert generate_ar(target, PROMPT, 0, SamplingParams())[0] == []
    with pytest.raises(ValueError, match="prompt is empty"):
        generate_ar(target, [], 4, SamplingParams())


def test_cli_json(tiny):
    path, target = tiny
    result = CliRunner().invoke(main, ["run", "--mode", "ar", "--model", str(path), "--drafter",
                                       str(path.parent / "drafter"), "def fib", "--max-new-tokens", "6",
                                       "--temperature", "0.7", "--seed", "5", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    want, _ = generate_ar(target, PROMPT[1:], 6, SamplingParams(temperature=0.7, seed=5),   # plain prompts get no BOS
                          eos_ids=target.config.eos_token_ids)
    assert out["tokens"] == want
    assert out["stats"]["new_tokens"] == len(want)
    assert out["text"] == ByteTokenizer(target.config.vocab_size).decode(want)


def test_prefill_is_not_a_step_even_for_a_one_token_prompt(tiny):
    _, target = tiny
    for prompt in ([256], PROMPT):
        tokens, stats = generate_ar(target, prompt, 5, SamplingParams())
        assert stats["new_tokens"] == 5 and stats["steps"] == 4 and stats["mean_accept_len"] == 1.0
