"""--budget auto on the CPU: the loop asks the chooser before every step; on the float64 engine executor DDTree
with auto budgets commits exactly AR's tokens; every step's budget is the brute-force best of the hand-made
cost table for the table the previous step left; `ddtree tune --device cpu` writes a tuning file the run reads."""
import json

import numpy as np
import pytest

from ddtree.builder.build import build_engine
from ddtree.data import tiny_model_dirs
from ddtree.engine_dir.tuning import Tuning, now_utc, write_tuning
from ddtree.runtime.auto_budget import AutoBudget
from ddtree.runtime.engine_executor import EngineExecutor
from ddtree.runtime.loop import RunStats, ar_steps, ddtree_steps, run_to_end
from ddtree.tree.budget import Calibration, expected_accept_for_table
from ddtree.tree.sampling import SamplingParams
from tests.cli.bad_input import ddtree, refuses

BUDGETS = (1, 4, 8, 16)
PROMPT = [256] + list(b"def fibonacci(n):\n    if n < 2:\n        return n\n")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return build_engine(*tiny_model_dirs(), 1, [], tmp_path_factory.mktemp("auto") / "e",
                        graphs=False, kernels=False)["engine"]      # the CPU executor reads no cubin


def hand_tuning(times_us) -> Tuning:
    return Tuning("hand-made", now_utc(), BUDGETS, (4096,), tuple((t,) for t in times_us), (0.0,) * len(BUDGETS),
                  Calibration.identity())


class Spy(AutoBudget):
    """AutoBudget that also keeps the table each choice saw."""
    def __call__(self, st):
        self.seen = getattr(self, "seen", []) + [None if st.draft_logp is None else st.draft_logp.copy()]
        return super().__call__(st)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=4)], ids=["greedy", "t0.8"])
def test_auto_budget_is_lossless_and_picks_the_best_rate(engine, params):
    ex = EngineExecutor(engine)
    times = (100.0, 110.0, 120.0, 5000.0)        # budget 16 far too slow: the best is 4 or 8 by the tables
    chooser = Spy(hand_tuning(times))
    stats = RunStats()
    dd = run_to_end(ddtree_steps(ex, PROMPT, 40, params, chooser, stats=stats))
    ar = run_to_end(ar_steps(ex, PROMPT, 40, params))
    assert dd == ar
    assert stats.budgets == chooser.chosen and len(stats.budgets) == stats.steps
    assert stats.to_dict()["budget_per_step"] and 16 not in stats.budgets
    for table, b in zip(chooser.seen[1:], chooser.chosen[1:]):        # each choice = the brute-force best rate
        ids = np.tile(np.arange(table.shape[1], dtype=np.int32), (table.shape[0], 1))
        e = expected_accept_for_table(0, table.astype(np.float32), ids, 16)
        rates = {c: e[c] / t for c, t in zip(BUDGETS, times)}
        assert rates[b] >= max(rates.values()) * (1 - 1e-12)
    assert chooser.chosen[0] == BUDGETS[len(BUDGETS) // 2]           # no table yet: the middle budget


def test_tune_on_the_cpu_writes_what_auto_reads(engine):
    r = ddtree(["tune", str(engine), "--device", "cpu", "--budget", "1,4", "--context", "128", "--prompts", "2",
                "--max-new-tokens", "8", "--json"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["budgets"] == [1, 4] and len(out["step_time_us"]) == 2 and out["calibration_edges"] > 0
    r = ddtree(["run", "--model", str(engine), "--budget", "auto", "--max-new-tokens", "12", "--mode", "both", "--json",
                "def f(x):"])
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["identical"] and set(res["stats"]["budget_per_step"]) <= {"1", "4"}


def test_auto_without_a_tuning_file_names_it(engine, tmp_path):
    import shutil
    copy = tmp_path / "e"
    shutil.copytree(engine, copy)
    (copy / "tuning.json").unlink(missing_ok=True)
    refuses(["run", "--model", str(copy), "--budget", "auto", "hi"], "tuning.json", "ddtree tune")
    refuses(["run", "--budget", "auto", "hi"], "'auto'", "engine directory")
    refuses(["run", "--budget", "sometimes", "hi"], "--budget", "'auto'", code=2)
    write_tuning(copy, hand_tuning((1.0, 2.0, 3.0, 4.0)))
    assert AutoBudget(hand_tuning((1.0, 2.0, 3.0, 4.0)), budgets=(4, 8)).budgets == [4, 8]
