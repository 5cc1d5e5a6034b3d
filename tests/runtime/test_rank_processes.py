"""Ranks as processes (runtime/ranks.py, parallel/shm_group.py): one process per rank of tp 2 and tp 4 engines of
the tiny and small-mla presets gives the tokens of the in-process executor (ranks as threads) and of the float64 reference
on the source checkpoint, DDTree == AR, greedy and sampled; the shared-memory all-reduce sums in rank order
(checked against an explicit float32 sum at 3 and 4 ranks, where the order changes the bits); a worker
killed mid-run, a frozen worker and a killed rank 0 each end with a named error within the bound and leave
no process (/proc) and no segment (/dev/shm) behind."""
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ddtree.builder.build import build_engine
from ddtree.model.synthetic import synth
from ddtree.parallel.shm_group import RankDiedError, RankError, RankUnresponsiveError, SharedMemoryGroup, new_spec
from ddtree.runtime.engine import DDTreeEngine
from ddtree.runtime.ranks import Committed, ControlRecord, RankProcesses, Request
from ddtree.tree.sampling import SamplingParams

SHM = Path("/dev/shm")
PROMPT = "def fib(n):"
SAMPLINGS = {"greedy": dict(), "sampled": dict(temperature=0.8, top_p=0.9, seed=5),
             "top-k": dict(temperature=1.1, top_k=20, seed=9)}
BOUND_S = 4.0                    # failure tests: heartbeat 1 s, collective timeout 3 s, plus the teardown


PRESETS = ("tiny", "small-mla")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {p: synth(tmp_path_factory.mktemp(f"ranks-{p}"), p, seed=24, shard_mb=8) for p in PRESETS}


@pytest.fixture(scope="module")
def all_engines(ckpts, tmp_path_factory):
    """(preset, tp) -> engine without cubins: the rank processes run the numpy backend, they read none."""
    root = tmp_path_factory.mktemp("ranks-engines")
    return {(p, tp): Path(build_engine(*ckpts[p], tp, [], root / f"{p}-tp{tp}", graphs=False,
                                      kernels=False)["engine"])
            for p in PRESETS for tp in (2, 4)}


@pytest.fixture(scope="module")
def reference_tokens(ckpts):
    """preset -> {sampling: the checkpoint engine's AR tokens}, generated once for both tp (they do not depend on it)."""
    memo = {}

    def tokens(preset):
        if preset not in memo:
            reference = DDTreeEngine.load(*ckpts[preset])
            memo[preset] = {name: reference.generate(PROMPT, max_new_tokens=20, budget=8, mode="ar", **kw).tokens
                            for name, kw in SAMPLINGS.items()}
        return memo[preset]
    return tokens


@pytest.fixture(scope="module")
def engines(all_engines):
    """tp -> the tiny preset's engine."""
    return {tp: all_engines["tiny", tp] for tp in (2, 4)}


def gone(pid: int) -> bool:
    """No such process, or a zombie (exited, waiting for its parent to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def wait_until(cond, timeout: float) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(0.02)
    return time.monotonic() - t0


# ----------------------------------------------------------------------------------------------
# the collectives

def _member(spec, rank, parts, conn):
    """A spawned rank: all-reduce each of `parts[rank]` in turn (back to back), then all-gather; send results."""
    group = SharedMemoryGroup(spec, rank, parent_pid=os.getppid())
    try:
        conn.send([group.all_reduce(rank, p, "test") for p in parts[rank]] +
                  [group.all_gather(rank, parts[rank][0], "test")])
    finally:
        group.close()


def ordered_f32(parts):
    out = parts[0].astype(np.float32)
    for p in parts[1:]:
        out = (out + p).astype(np.float32)
    return out


@pytest.mark.parametrize("n", [3, 4])
def test_one_shot_sum_is_the_float32_sum_in_rank_order(n):
    rng = np.random.default_rng(n)
    scales = [1e7, 1.0, -1e7, 1e-3][:n]
    # 3 messages back to back (both slots, reused) and one of 40,000 bytes over 4 KiB slots (10 chunks)
    shapes = [(257,), (3, 5), (257,), (10_000,)]
    parts = [[(s * rng.standard_normal(shape)).astype(np.float32) for shape in shapes] for s in scales]
    spec = new_spec(n, slot_bytes=4096, timeout_s=20.0, heartbeat_s=10.0)
    ctx = mp.get_context("spawn")
    group = SharedMemoryGroup(spec, 0, create=True)
    pipes = [ctx.Pipe() for _ in range(1, n)]
    procs = [ctx.Process(target=_member, args=(spec, r, parts, pipes[r - 1][1])) for r in range(1, n)]
    try:
        for p in procs:
            p.start()
        results = [[group.all_reduce(0, p, "test") for p in parts[0]] + [group.all_gather(0, parts[0][0], "test")]]
        results += [pipe[0].recv() for pipe in pipes]
    finally:
        for p in procs:
            p.join(10)
        group.close()
    assert not (SHM / spec.name).exists()
    differs = 0
    for m in range(len(shapes)):
        want = ordered_f32([parts[r][m] for r in range(n)])
        reverse = ordered_f32([parts[r][m] for r in reversed(range(n))])
        differs += int((want != reverse).sum())
        for r in range(n):
            assert results[r][m].dtype == np.float32
            np.testing.assert_array_equal(results[r][m], want)             # bit for bit, on every rank
    assert differs > 0                                                      # the data makes the order visible
    for r in range(n):
        np.testing.assert_array_equal(results[r][-1], np.stack([parts[q][0] for q in range(n)]))


# ----------------------------------------------------------------------------------------------
# whole generations

@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("tp", [2, 4])
def test_rank_processes_give_the_threads_and_reference_tokens(reference_tokens, all_engines, preset, tp):
    wants = reference_tokens(preset)
    threads = DDTreeEngine.load(all_engines[preset, tp])
    with DDTreeEngine.load(all_engines[preset, tp], ranks="processes") as procs:
        workers = list(procs.processes.pids.values())
        assert len(workers) == tp - 1
        for name, kw in SAMPLINGS.items():
            want = wants[name]
            assert threads.generate(PROMPT, max_new_tokens=20, budget=8, **kw).tokens == want, name
            for mode in ("ddtree", "ar"):
                got = procs.generate(PROMPT, max_new_tokens=20, budget=8, mode=mode, **kw)
                assert got.tokens == want, (name, mode)
        # a request stopped after its first step leaves every rank ready for the next one
        stream = procs.stream(PROMPT, max_new_tokens=20, budget=8)
        next(stream)
        stream.close()
        assert procs.generate(PROMPT, max_new_tokens=20, budget=8).tokens == wants["greedy"]
    wait_until(lambda: all(gone(p) for p in workers), 5.0)
    assert not list(SHM.glob(f"ddtree_{os.getpid()}_*"))


# ----------------------------------------------------------------------------------------------
# failures

def _fail_during_generation(engine, act) -> tuple[RankError, float, list[int], RankProcesses]:
    """Start a long generation on tp 4 rank processes, `act(pids)` after its first steps (from another
    thread, so it lands mid-step); -> (the error raised, seconds from act to the error, worker pids)."""
    procs = RankProcesses(engine, timeout_s=3.0, heartbeat_s=1.0)
    pids = list(procs.pids.values())
    acted = []
    request = Request("ddtree", tuple(b"def fib(n):"), 600, SamplingParams(), 8, ())
    steps = procs.steps(request)
    next(steps)
    timer = threading.Timer(0.1, lambda: (act(procs.pids), acted.append(time.monotonic())))
    timer.start()
    with pytest.raises(RankError) as err:
        for _ in steps:
            pass
    took = time.monotonic() - acted[0]
    timer.join()
    return err.value, took, pids, procs


def check_nothing_left(pids, procs):
    assert all(gone(p) for p in pids), [p for p in pids if not gone(p)]
    assert not (SHM / procs.spec.name).exists()
    with pytest.raises(RankError, match="take no more requests"):
        procs.steps(Request("ar", (1, 2), 2, SamplingParams(), 8, ()))


def test_a_killed_worker_is_named_and_everything_stops(engines):
    err, took, pids, procs = _fail_during_generation(engines[4], lambda p: os.kill(p[2], signal.SIGKILL))
    assert isinstance(err, RankDiedError), err
    assert "rank 2" in str(err) and "SIGKILL" in str(err)
    assert "all_reduce #" in str(err) or "all_gather #" in str(err) or "control record" in str(err)
    assert took < BOUND_S
    check_nothing_left(pids, procs)


def test_a_frozen_worker_is_named_and_everything_stops(engines):
    err, took, pids, procs = _fail_during_generation(engines[4], lambda p: os.kill(p[1], signal.SIGSTOP))
    assert isinstance(err, RankUnresponsiveError), err
    assert "rank 1 sent no heartbeat" in str(err)
    assert took < BOUND_S
    check_nothing_left(pids, procs)


RANK0 = """
import json, sys
from ddtree.runtime.ranks import Committed, ControlRecord, RankProcesses, Request
from ddtree.tree.sampling import SamplingParams
if __name__ == "__main__":
    procs = RankProcesses(sys.argv[1], timeout_s=3.0, heartbeat_s=1.0)
    print(json.dumps({"segment": procs.spec.name, "workers": list(procs.pids.values())}), flush=True)
    while True:
        for chunk in procs.steps(Request("ddtree", tuple(b"def fib(n):"), 600, SamplingParams(), 8, ())):
            pass
"""


def test_workers_of_a_killed_rank_0_leave_nothing_behind(engines, tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(RANK0)
    rank0 = subprocess.Popen([sys.executable, str(script), str(engines[4])], stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(rank0.stdout.readline())
        time.sleep(0.5)                                                     # in the middle of generating
        spawned = children(rank0.pid)                                       # the workers, the resource tracker
        assert set(info["workers"]) <= set(spawned)
        rank0.kill()
        rank0.wait()
        took = wait_until(lambda: all(gone(p) for p in spawned) and not (SHM / info["segment"]).exists(), BOUND_S)
    finally:
        rank0.kill()
        rank0.wait()
    assert took < BOUND_S


def test_a_worker_whose_committed_tokens_differ_is_stopped(monkeypatch):
    """The control record carries a digest of every committed token, so a worker that committed other tokens than
    rank 0 (same counts) fails at the next step instead of going on (runtime/ranks.py _follow)."""
    import ddtree.runtime.ranks as ranks
    from ddtree.parallel.shm_group import RankFailedError
    req = Request("ddtree", (1, 2, 3), 8, SamplingParams(), 4, ())
    rank0 = [[5, 6], [7], [8, 9]]                       # what rank 0 committed, step by step

    class Conn:
        def __init__(self, records):
            self.records = list(records)

        def poll(self, timeout):
            return True

        def recv(self):
            return self.records.pop(0)
    committed, records = Committed(), []
    for step, chunk in enumerate(rank0):
        records.append(ControlRecord.of(req, step, committed))
        committed = committed.plus(chunk)
    records.append(ControlRecord.of(req, len(rank0), committed, stop=True))
    group = type("G", (), {"count": 0})()
    for worker, fails_at in (([[5, 6], [7], [8, 9]], None), ([[5, 6], [4], [8, 9]], 2)):
        monkeypatch.setattr(ranks, "decode_steps", lambda ex, r, w=worker: (chunk for chunk in w))
        conn = Conn(records)
        if fails_at is None:
            ranks._follow(None, group, conn, req, os.getppid(), 1)
            assert conn.records == []
        else:
            with pytest.raises(RankFailedError, match="rank 1 diverged"):
                ranks._follow(None, group, conn, req, os.getppid(), 1)
            assert len(conn.records) == len(records) - fails_at - 1      # stopped at step fails_at's record
