"""CPU tests of the rank-process launcher (parallel/spawn_ranks.py) the 2-GPU collectives use: exchanges come back
in rank order on every rank, a failing or exiting rank is named, a killed rank allowed by may_exit drops
out of later exchanges, a silent rank times out, with no process left behind, and a rank's stdout writes (NCCL's
debug lines are C writes to file descriptor 1) reach stderr, not the parent's stdout."""
import os
import signal
import subprocess
import sys
import time

import pytest

from ddtree.parallel.spawn_ranks import RankProcessError, run_ranks


def exchanging(link, gpu_id, rounds):
    seen = [link.all_exchange((link.rank, gpu_id, k)) for k in range(rounds)]
    return {"pid": os.getpid(), "seen": seen}


def failing(link, gpu_id):
    link.all_exchange(None)
    if link.rank == 1:
        raise ValueError("rank one broke")
    return link.all_exchange("never completes")


def killed(link, gpu_id):
    link.all_exchange("up")
    if link.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return link.all_exchange(link.rank)


def silent(link, gpu_id):
    if link.rank == 0:
        time.sleep(60)
    return link.rank


def test_exchanges_in_rank_order():
    results = run_ranks(exchanging, [5, 3, 4], args=(2,))
    for res in results:
        assert res["seen"] == [[(0, 5, k), (1, 3, k), (2, 4, k)] for k in range(2)]
    assert len({res["pid"] for res in results}) == 3


def test_a_failing_rank_is_named():
    with pytest.raises(RankProcessError, match=r"rank 1 \(GPU 1\) failed:[\s\S]*rank one broke"):
        run_ranks(failing, [0, 1])


def test_killed_rank_drops_out_when_allowed_and_is_named_otherwise():
    assert run_ranks(killed, [0, 1], may_exit={1}) == [[0, None], None]
    with pytest.raises(RankProcessError, match=r"rank 1 \(GPU 1\) exited \(code -9\)"):
        run_ranks(killed, [0, 1])


def test_a_silent_rank_times_out():
    t0 = time.monotonic()
    with pytest.raises(RankProcessError, match=r"rank\(s\) \[0\] did not finish within 3"):
        run_ranks(silent, [0, 1], timeout_s=3)
    assert time.monotonic() - t0 < 20


def printing(link, gpu_id):
    print(f"python print of rank {link.rank}", flush=True)
    os.write(1, f"fd 1 write of rank {link.rank}\n".encode())       # as C code (NCCL's INFO lines) writes
    return link.rank


PARENT = """
import json, sys
from ddtree.parallel.spawn_ranks import run_ranks
from tests.parallel.test_spawn_ranks import printing
print(json.dumps({"ranks": run_ranks(printing, [0, 1])}))
"""


def test_rank_output_goes_to_stderr_not_the_parents_stdout():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", PARENT], capture_output=True, text=True, timeout=120, cwd=root,
                          env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0, done.stderr
    assert done.stdout == '{"ranks": [0, 1]}\n'                      # the parent's JSON alone
    for rank in (0, 1):
        assert f"python print of rank {rank}" in done.stderr and f"fd 1 write of rank {rank}" in done.stderr
