"""`ddtree bench e2e --concurrency` (bench/e2e_batch.py) on the float64 reference executor: its rows against their
own definitions and against the loops run alone, the lossless check it makes, and the flag's refusal on cuda."""
import pytest
from click.testing import CliRunner

from ddtree.bench import e2e_batch
from ddtree.bench.accept import load_models
from ddtree.bench.e2e import LosslessError, heldout_texts
from ddtree.cli import main
from ddtree.data import tiny_model_dirs
from ddtree.model.tokenizer import load_tokenizer
from ddtree.runtime.loop import ar_steps, ddtree_steps, run_to_end
from ddtree.tree.sampling import SamplingParams

N = 6
PARAMS = SamplingParams(temperature=0.8, top_k=40, seed=5)


@pytest.fixture(scope="module")
def setup():
    target_dir, drafter_dir = tiny_model_dirs()
    ex = load_models(target_dir, drafter_dir)
    tok = load_tokenizer(target_dir, ex.config)
    return ex, tok, [tok.encode(t) for t in heldout_texts(2)]


@pytest.fixture(scope="module")
def rows(setup):
    ex, tok, prompts = setup
    return e2e_batch.run_concurrency(ex, tok, prompts, [4], N, PARAMS, 1, [1, 3])


def test_rows_follow_their_definitions(rows):
    assert [(r["mode"], r["budget"], r["concurrency"]) for r in rows] == [
        ("ar", None, 1), ("ar", None, 3), ("ddtree", 4, 1), ("ddtree", 4, 3)]
    for r in rows:
        assert r["requests"] == (2 if r["concurrency"] == 1 else 4)        # at least c, a multiple of the prompts
        assert r["new_tokens"] == r["requests"] * N and r["identical"] is True
        assert r["aggregate_tokens_per_s"] == pytest.approx(r["new_tokens"] / r["wall_s"])
        assert r["aggregate_decode_tokens_per_s"] == pytest.approx(                 # the first tokens left out
            (r["new_tokens"] - r["requests"]) / (r["wall_s"] - r["ttft_s"]["min"]))
        for key in ("decode_tokens_per_s", "ttft_s"):
            s = r[key]
            assert 0 < s["min"] <= s["mean"] <= s["max"] and s["sd"] >= 0
        assert r["ttft_s"]["max"] <= r["wall_s"]
    ar1 = rows[0]
    assert ar1["steps"] == 2 * (N - 1) and ar1["mean_accept_len"] == 1.0
    assert rows[2]["mean_accept_len"] > 1.0


def test_the_tokens_are_the_loops_alone(setup, monkeypatch):
    """concurrency_row's outputs are ar_steps / ddtree_steps run alone on each prompt (ignoring EOS, as the bench)."""
    ex, tok, prompts = setup
    engine = e2e_batch.DDTreeEngine(ex, tok, None, None)
    for budget in (None, 4):
        _, outs = e2e_batch.concurrency_row(engine, prompts, budget, N, PARAMS, 3, 1)
        for i, out in enumerate(outs):
            ids = prompts[i % 2]
            alone = run_to_end(ar_steps(ex, ids, N, PARAMS) if budget is None else ddtree_steps(ex, ids, N, PARAMS, 4))
            assert out == alone


def test_a_request_that_changes_with_concurrency_fails_the_bench(setup, monkeypatch):
    ex, tok, prompts = setup
    real = e2e_batch.run_batch

    def corrupted(engine, jobs, c):
        out = real(engine, jobs, c)
        if c == 2:
            out[1]["tokens"][-1] += 1
        return out
    monkeypatch.setattr(e2e_batch, "run_batch", corrupted)
    with pytest.raises(LosslessError, match="concurrency 2: request 1 differs"):
        e2e_batch.run_concurrency(ex, tok, prompts, [], 4, PARAMS, 1, [1, 2])


def test_a_bad_concurrency_is_refused_naming_the_flag():
    r = CliRunner().invoke(main, ["bench", "e2e", "--concurrency", "0,2"])
    assert r.exit_code == 2 and "--concurrency" in r.output
