"""A full /dev/shm (issue 52, rank processes): the rank group's segment is checked against the free space and
every page reserved at creation, so a short tmpfs is a named ResourceError before any rank starts, never a
SIGBUS at the first write. The real cases run in a private mount namespace with a 1 MiB tmpfs on /dev/shm
(skipped where unshare or mount is not allowed)."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import pytest

from ddtree.errors import ResourceError
from ddtree.parallel import shm_group
from ddtree.parallel.shm_group import SharedMemoryGroup, new_spec

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def in_small_shm(script: str, size: str = "1M") -> subprocess.CompletedProcess:
    """Python `script` with /dev/shm a fresh tmpfs of `size`, in a mount namespace of its own."""
    shell = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$0" -c "$1"'
    return subprocess.run(["unshare", "--mount", "bash", "-c", shell, sys.executable, textwrap.dedent(script)],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO})


@functools.cache
def namespaces_allowed() -> bool:
    try:
        return in_small_shm("pass").returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_namespace = pytest.mark.skipif("not namespaces_allowed()", reason="unshare --mount / mount not allowed here")


@needs_namespace
def test_a_short_dev_shm_is_named_before_the_segment_exists():
    r = in_small_shm("""
        import os
        from ddtree.errors import ResourceError
        from ddtree.parallel.shm_group import SharedMemoryGroup, new_spec
        spec = new_spec(4)                                  # 8 MiB of slots, the tmpfs holds 1 MiB
        try:
            SharedMemoryGroup(spec, 0, create=True)
        except ResourceError as e:
            print("refused:", e)
        print("left:", os.listdir("/dev/shm"))
    """)
    assert r.returncode == 0, r.stderr
    assert "refused: /dev/shm: the rank group's shared memory needs 8391232 bytes, 1048576 are free" in r.stdout
    assert "left: []" in r.stdout


@needs_namespace
def test_space_that_vanishes_after_the_check_is_named_not_a_sigbus():
    """The free-space check passes (it is told so), another writer took the pages: reserving them at
    creation says ENOSPC; without the reservation the first write past 1 MiB would be a SIGBUS."""
    r = in_small_shm("""
        import os
        from ddtree.errors import ResourceError
        from ddtree.parallel import shm_group
        shm_group.shm_free_bytes = lambda: 1 << 40
        try:
            g = shm_group.SharedMemoryGroup(shm_group.new_spec(4), 0, create=True)
            g.data[:] = 1                                   # would be a SIGBUS past the tmpfs's 1 MiB
            print("wrote")
        except ResourceError as e:
            print("refused:", e)
        print("left:", os.listdir("/dev/shm"))
    """)
    assert r.returncode == 0, (r.returncode, r.stderr)       # -7 would be the SIGBUS
    assert "refused: /dev/shm: could not reserve the rank group's 8391232 bytes" in r.stdout
    assert "No space left on device" in r.stdout and "left: []" in r.stdout


@needs_namespace
def test_a_group_that_fits_runs():
    r = in_small_shm("""
        import numpy as np
        from ddtree.parallel.shm_group import SharedMemoryGroup, new_spec
        g = SharedMemoryGroup(new_spec(1, slot_bytes=1024), 0, create=True)
        print(g.all_reduce(0, np.arange(4.0)).tolist())
        g.close()
    """)
    assert r.returncode == 0 and "[0.0, 1.0, 2.0, 3.0]" in r.stdout, r.stderr


def test_every_page_is_reserved_at_creation():
    """On the real /dev/shm: the segment's allocated blocks cover its size before anything is written."""
    spec = new_spec(2, slot_bytes=1 << 16)
    g = SharedMemoryGroup(spec, 0, create=True)
    try:
        st = os.stat(f"/dev/shm/{spec.name}")
        assert st.st_size == spec.nbytes() and st.st_blocks * 512 >= spec.nbytes()
    finally:
        g.close()
    assert not os.path.exists(f"/dev/shm/{spec.name}")


def test_the_check_uses_the_free_space(monkeypatch):
    spec = new_spec(2, slot_bytes=1 << 16)
    monkeypatch.setattr(shm_group, "shm_free_bytes", lambda: spec.nbytes() - 1)
    with pytest.raises(ResourceError, match=rf"needs {spec.nbytes()} bytes, {spec.nbytes() - 1} are free"):
        SharedMemoryGroup(spec, 0, create=True)
    assert not os.path.exists(f"/dev/shm/{spec.name}")
