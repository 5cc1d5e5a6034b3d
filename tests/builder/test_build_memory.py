"""The builder's memory bound (docs/architecture.md principle 4): building an engine from a > 2 GB
checkpoint whose embed_tokens and lm_head are 1 GiB each keeps the peak RSS of `ddtree-build`,
measured by the kernel for that one child process (wait4), under 1 GiB. Reading any tensor whole,
or holding a rank's file in memory, would break the bound."""
import json
import os
import shutil
import sys

import numpy as np
import pytest
from big_checkpoint import write_big_checkpoint

from ddtree.builder.tensor_io import TensorReader
from ddtree.engine_dir import rank_dir
from ddtree.model.checkpoint import Checkpoint
from ddtree.model.safetensors_io import SafetensorsFile

LIMIT_BYTES = 1 << 30


def run_measured(args, log_dir):
    """Run `ddtree-build ARGS` in a child process -> (exit code, peak RSS bytes, stdout, stderr)."""
    # The child's own VmHWM, written at exit. Not wait4's ru_maxrss: Linux carries the spawning
    # process's (pytest's, often > 1 GiB) high-water mark into it across exec; VmHWM is per address space.
    hwm = log_dir / "vmhwm.txt"
    code = ("import atexit, sys; atexit.register(lambda: open(%r, 'w').write(next(l.split()[1] for l in "
            "open('/proc/self/status') if l.startswith('VmHWM'))));"
            "from ddtree.cli import build_command; sys.argv[0] = 'ddtree-build'; build_command()" % str(hwm))
    with open(log_dir / "out.txt", "w") as out, open(log_dir / "err.txt", "w") as err:
        pid = os.posix_spawn(sys.executable, [sys.executable, "-c", code, *map(str, args)], os.environ,
                             file_actions=[(os.POSIX_SPAWN_DUP2, out.fileno(), 1), (os.POSIX_SPAWN_DUP2, err.fileno(), 2)])
        _, status, _ = os.wait4(pid, 0)
    return (os.waitstatus_to_exitcode(status), int(hwm.read_text()) * 1024,   # VmHWM in KiB
            (log_dir / "out.txt").read_text(), (log_dir / "err.txt").read_text())


@pytest.fixture
def scratch(tmp_path):
    """tmp_path, emptied afterwards: pytest keeps old tmp dirs, and these hold 4.5 GB."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.slow
def test_build_of_a_2gb_checkpoint_stays_under_1gb_rss(scratch):
    tmp_path = scratch
    target, drafter = write_big_checkpoint(tmp_path / "ckpt")
    ckpt_bytes = sum(f.stat().st_size for f in (tmp_path / "ckpt").rglob("*.safetensors"))
    assert ckpt_bytes > 2 * 10**9
    out = tmp_path / "engine"
    rc, rss, stdout, stderr = run_measured(["--model", target, "--drafter", drafter, "--tp", "2", "--arch", "sm_120",
                                            "--out", out, "--json"], tmp_path)
    assert rc == 0, stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert rss < LIMIT_BYTES, f"peak RSS {rss / 2**20:.0f} MiB building from {ckpt_bytes / 2**30:.2f} GiB"
    assert summary["peak_rss_mb"] * 2**20 <= rss * 1.01                 # the build reports its own peak too
    print(f"ddtree-build peak RSS {rss / 2**20:.0f} MiB for a {ckpt_bytes / 2**30:.2f} GiB checkpoint")
    # the 1 GiB lm_head really went through: rank 1's last rows are the checkpoint's last rows
    ck = Checkpoint(target)
    f = SafetensorsFile(rank_dir(out, 1) / "head.safetensors")
    spec = f.entries["lm_head.weight"]
    assert spec.shape == (ck.config.vocab_size // 2, ck.config.hidden_size)
    head = np.memmap(f.path, np.uint16, "r", f.data_start + f.offsets["lm_head.weight"][0], spec.shape)
    reader = TensorReader(ck)
    np.testing.assert_array_equal(head[-3:], reader.rows("lm_head.weight", ck.config.vocab_size - 3, ck.config.vocab_size))
    reader.close()
