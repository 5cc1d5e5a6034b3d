"""`ddtree bench e2e` (issue 20) on the CPU: its JSON, its numbers against the numpy reference executor, the
lossless check it makes, and its flag errors."""
import json
import statistics

import numpy as np
import pytest
from click.testing import CliRunner

from ddtree.bench.accept import load_models
from ddtree.bench.e2e import LosslessError, check_lossless, heldout_texts, spread
from ddtree.cli import main
from ddtree.data import tiny_model_dirs
from ddtree.model.tokenizer import load_tokenizer
from ddtree.runtime.loop import RunStats, ar_steps, ddtree_steps, run_to_end
from ddtree.tree.sampling import SamplingParams

N = 8
ROW_KEYS = {"mode", "budget", "tokens_per_s", "mean_accept_len", "steps", "host_us_per_step", "capture_s",
            "speedup_vs_ar", "phases", "identical"}


def e2e(*args):
    return CliRunner().invoke(main, ["bench", "e2e", *args])


@pytest.fixture(scope="module")
def out():
    r = e2e("--device", "cpu", "--prompts", "1", "--max-new-tokens", str(N), "--budget", "1,4", "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_json_schema(out):
    assert {"device", "model", "prompts", "max_new_tokens", "sampling", "memory", "rows"} <= set(out)
    assert out["bench"] == "e2e" and out["device"] == "cpu" and out["memory"] is None
    assert out["prompts"] == 1 and out["max_new_tokens"] == N and out["sampling"]["temperature"] == 0.0
    assert [(r["mode"], r["budget"]) for r in out["rows"]] == [("ar", None), ("ddtree", 1), ("ddtree", 4)]
    for r in out["rows"]:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert set(r["tokens_per_s"]) == {"mean", "sd", "min", "max"}
        assert r["phases"] is None and r["capture_s"] is None and r["host_us_per_step"] is None   # CPU: no graphs
    assert "captured alone" in out["notes"]["phases"]


def test_numbers_are_sane_and_match_the_reference_executor(out):
    """Steps and acceptance equal those of the float64 NumpyExecutor on the source checkpoint (another
    executor, same math), every rate is positive and inside its own min..max, speedups are the ratios."""
    target_dir, drafter_dir = tiny_model_dirs()
    ref = load_models(target_dir, drafter_dir)
    ids = load_tokenizer(target_dir, ref.config).encode(heldout_texts(1)[0])
    ar_stats = RunStats()
    ar = run_to_end(ar_steps(ref, ids, N, SamplingParams(), (), ar_stats))
    ar_row = out["rows"][0]
    assert ar_row["steps"] == ar_stats.steps == N - 1 and ar_row["mean_accept_len"] == 1.0
    for r in out["rows"]:
        t = r["tokens_per_s"]
        assert t["mean"] > 0 and t["min"] <= t["mean"] <= t["max"] and t["sd"] >= 0
        assert r["speedup_vs_ar"] == pytest.approx(t["mean"] / ar_row["tokens_per_s"]["mean"])
        assert r["new_tokens"] == N
        if r["mode"] == "ddtree":
            stats = RunStats()
            assert run_to_end(ddtree_steps(ref, ids, N, SamplingParams(), r["budget"], (), None, stats)) == ar
            assert r["steps"] == stats.steps and r["identical"] is True
            assert r["mean_accept_len"] == pytest.approx(sum(stats.accept_lens) / stats.steps, rel=1e-12)
            assert r["mean_accept_len"] >= 1 and r["mean_accept_len"] * r["steps"] == pytest.approx(N - 1)


def test_lossless_check_names_where_outputs_part():
    check_lossless([[1, 2, 3]], [[1, 2, 3]], 4)
    with pytest.raises(LosslessError, match="budget 4, prompt 1: .* new token 2"):
        check_lossless([[5], [1, 2, 3]], [[5], [1, 2, 9]], 4)
    with pytest.raises(LosslessError, match="new token 2"):                     # one output a prefix of the other
        check_lossless([[1, 2, 3]], [[1, 2]], 4)


def test_spread_is_the_sample_statistics():
    x = [3.0, 5.0, 10.0]
    s = spread(x)
    assert s["mean"] == pytest.approx(np.mean(x)) and s["sd"] == pytest.approx(np.std(x, ddof=1))
    assert (s["min"], s["max"]) == (3.0, 10.0) and spread([4.0])["sd"] == 0.0
    assert s["sd"] == pytest.approx(statistics.stdev(x))


@pytest.mark.parametrize("budget", ["1,x", "0", "256", ","])
def test_bad_budget_names_the_flag(budget):
    r = e2e("--budget", budget)
    assert r.exit_code == 2 and "--budget" in r.output, r.output


def test_too_many_prompts_names_the_flag():
    r = e2e("--prompts", "100000")
    assert r.exit_code == 2 and "--prompts" in r.output and "held-out" in r.output, r.output


def test_cuda_without_a_gpu_names_what_is_missing(monkeypatch):
    import ddtree.bench.e2e as e2e_module
    monkeypatch.setattr(e2e_module, "gpu_unavailable", lambda gpu=0: f"--gpu {gpu}: this machine has 0 CUDA GPU(s)")
    r = e2e("--device", "cuda", "--gpu", "3")
    assert r.exit_code == 1 and "--device cuda is not available: --gpu 3: this machine has 0" in r.output, r.output


def test_cuda_unavailable_here_is_a_clear_error():
    """Unpatched: on a machine without a GPU or cuda-python, the real reason (skipped where a GPU is usable)."""
    from ddtree.runtime.cuda_executor import gpu_unavailable
    why = gpu_unavailable(0)
    if why is None:
        pytest.skip("a GPU is usable here")
    r = e2e("--device", "cuda")
    assert r.exit_code == 1 and why in r.output, r.output
