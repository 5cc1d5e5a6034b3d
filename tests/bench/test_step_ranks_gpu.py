"""`ddtree bench step --ranks all` on one GPU (a rehearsal of issue 29's 8-GPU run): small-mla's tp 2 plan as two rank
processes sharing GPU 0, each generating its weights and replaying the step graph with stand-ins, then with the
one-shot all-reduces between the processes inside. Every rank answers every collective (no error bit), every row
has both ranks' medians, and the step with the collectives costs at least the stand-in step's all-reduce-free
compute on rank 0 (the two processes share the GPU, so the times are time-sliced: only sanity is asserted)."""
import json
import math

import pytest

from tests.cli.bad_input import ddtree

pytestmark = pytest.mark.gpu


def test_all_ranks_step_on_one_gpu():
    r = ddtree(["bench", "step", "--preset", "small-mla", "--tp", "2", "--ranks", "all", "--gpu", "0,0",
                "--context", "256", "--budget", "4", "--routing", "uniform", "--ar", "--repeats", "3", "--json"],
               timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ranks"] == "all" and out["tp"] == 2 and out["gpus"] == [0, 0]
    assert out["one_shot_errors"] == [] and out["notes"]["shared_gpus"]
    assert [(row["mode"], row["budget"]) for row in out["rows"]] == [("ar", None), ("ddtree", 4)]
    for row in out["rows"]:
        for key in ("single_rank_us", "with_collectives_us"):
            assert len(row[key]) == 2 and all(math.isfinite(t) and t > 0 for t in row[key]), row
        assert row["step_us"] == max(row["with_collectives_us"])
        assert row["skew_us"] >= 0
    print(json.dumps(out["rows"], indent=1))
