"""`ddtree-build --no-kernels` on the base install: in an interpreter where the `cuda` package cannot be imported
(no NVRTC), it builds an engine directory the CPU executor runs (the same tokens as the checkpoint it came
from), recorded as kernel-less in config.json (hashed by the manifest), and `--device cuda` refuses it by name
before touching a GPU."""
import json
import os
import subprocess
import sys

import pytest

from ddtree.engine_dir import config_path, manifest_path
from ddtree.runtime.engine import DDTreeEngine
from ddtree.runtime.loop import RequestError

NO_CUDA = ("import sys; sys.modules['cuda'] = None\n"          # `import cuda...` raises ImportError from here on
           "from ddtree.cli import main\n"
           "main(sys.argv[1:])\n")


@pytest.fixture(scope="module")
def kernel_less(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("nk") / "engine"
    args = ["build", "--model", str(tiny_ckpt[0]), "--drafter", str(tiny_ckpt[1]), "--tp", "1", "--no-kernels",
            "--no-graphs", "--out", str(out), "--json"]
    r = subprocess.run([sys.executable, "-c", NO_CUDA, *args], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert r.returncode == 0, r.stderr
    return out, json.loads(r.stdout.strip().splitlines()[-1])


def test_kernel_less_engine_runs_on_cpu(kernel_less, tiny_ckpt):
    out, summary = kernel_less
    assert summary["kernels"] == "skipped" and summary["archs"] == []
    config = json.loads(config_path(out).read_text())
    assert config["archs"] == [] and config["kernels"] == {} and "--no-kernels" in config["kernels_skipped"]
    assert config["source"]["nvrtc"] is None
    assert "config.json" in json.loads(manifest_path(out).read_text())["files"]
    assert not (out / "kernels").exists()
    got = DDTreeEngine.load(out).generate("def", max_new_tokens=16, budget=4).tokens
    want = DDTreeEngine.load(*tiny_ckpt).generate("def", max_new_tokens=16, budget=4).tokens
    assert got == want


def test_device_cuda_refuses_it_by_name(kernel_less):
    out, _ = kernel_less
    with pytest.raises(RequestError, match="built with --no-kernels.*--device cpu"):
        DDTreeEngine.load(out, device="cuda")


def test_no_kernels_with_arch_and_no_arch_at_all(tiny_ckpt, tmp_path):
    from click.testing import CliRunner

    from ddtree.cli import main
    base = ["build", "--model", str(tiny_ckpt[0]), "--drafter", str(tiny_ckpt[1]), "--out", str(tmp_path / "x")]
    r = CliRunner().invoke(main, base + ["--no-kernels", "--arch", "sm_120"])
    assert r.exit_code != 0 and "--no-kernels: give no --arch" in r.output
    r = CliRunner().invoke(main, base)
    assert r.exit_code != 0 and "--no-kernels" in r.output and "--arch" in r.output


def test_compile_notice_counts_the_cache_misses(tmp_path):
    """A kernel compile says how many kernels miss the cache and about how long they take; nothing when all hit."""
    from ddtree.plugins import compile as kc
    jobs = kc.kernel_jobs(("sm_90", "sm_120"))
    notice = kc.compile_notice(jobs, tmp_path, 2)
    assert f"compiling {len(jobs)} of {len(jobs)} kernels" in notice and str(tmp_path) in notice
    assert f"about {round(kc.COLD_COMPILE_S, -1):.0f} s" in notice
    for job in jobs[1:]:                            # all cached but one
        kc.cubin_path(*job, cache=tmp_path).write_bytes(b"x")
    assert f"compiling 1 of {len(jobs)} kernels" in kc.compile_notice(jobs, tmp_path, 2)
    kc.cubin_path(*jobs[0], cache=tmp_path).write_bytes(b"x")
    assert kc.compile_notice(jobs, tmp_path, 2) is None
