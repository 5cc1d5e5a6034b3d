"""The CLI against hostile inputs and exhausted resources (issue 52, CLI): endless prompt files are refused
after a bounded read, every OS error (a full disk, a missing or impossible directory) is the one-line
`Error: <Type>: ...` with exit 1, synth checks its disk and memory estimates before it builds anything,
rich's output into a closed pipe ends with the quiet 141 of every other command, and an error after
partial streamed text starts a line of its own."""
from __future__ import annotations

import io
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from ddtree.cli import main
from ddtree.cli_types import MAX_PROMPT_BYTES, PromptError, read_prompt_bytes
from tests.cli.bad_input import ddtree, refuses


def one_line_error(r, error_type: str) -> str:
    err = r.stderr if isinstance(r.stderr, str) else r.stderr.decode(errors="replace")
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert r.returncode == 1, (r.returncode, err)
    lines = [line for line in err.splitlines() if line.startswith("Error: ")]
    assert len(lines) == 1 and lines[0].startswith(f"Error: {error_type}: "), err
    return lines[0]


def shell(script: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """bash -c SCRIPT with $0 the interpreter (`"$0" -m ddtree ...`)."""
    return subprocess.run(["bash", "-c", script, sys.executable], capture_output=True, text=True, timeout=timeout)


# ---- prompts read with a limit ----------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_endless_prompt_files_are_refused_after_a_bounded_read(device):
    t0 = time.monotonic()
    r = refuses(["run", "--prompt-file", device], "Error: PromptError: ", device, str(MAX_PROMPT_BYTES))
    assert time.monotonic() - t0 < 30 and r.stdout == ""


def test_endless_stdin_is_refused_after_a_bounded_read():
    r = shell('"$0" -m ddtree run --max-new-tokens 1 < /dev/zero')
    assert "<stdin>" in one_line_error(r, "PromptError")


def test_the_limit_is_exact():
    limit = 1000
    assert read_prompt_bytes(io.BytesIO(b"a" * limit), "p.txt", limit) == b"a" * limit
    with pytest.raises(PromptError, match=r"p\.txt: longer than 1000 bytes"):
        read_prompt_bytes(io.BytesIO(b"a" * (limit + 1)), "p.txt", limit)


# ---- OS errors are one line ---------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [
    '"$0" -m ddtree run "def f" --max-new-tokens 3 > /dev/full',
    '"$0" -m ddtree run "def f" --max-new-tokens 3 --json > /dev/full',
    '"$0" -m ddtree bench project --budget 8 --context 4096 --json > /dev/full',
    '"$0" -m ddtree --help > /dev/full',
])
def test_a_full_disk_on_stdout_is_one_line(args):
    line = one_line_error(shell(args), "OSError")
    assert "No space left on device" in line


@pytest.mark.parametrize("out, error_type", [
    ("/proc/nope/ckpt", None), ("/dev/null/ckpt", "NotADirectoryError"), ("/dev/full/ckpt", "NotADirectoryError"),
])
def test_synth_into_an_impossible_directory_is_one_line(out, error_type):
    r = ddtree(["synth", "--preset", "tiny", "--out", out], timeout=120)
    err = r.stderr
    assert "Traceback" not in err and r.returncode == 1, err
    line = [x for x in err.splitlines() if x.startswith("Error: ")]
    assert len(line) == 1 and (error_type is None or line[0].startswith(f"Error: {error_type}: ")), err
    assert out.split("/ckpt")[0] in line[0]


# ---- synth checks resources first ---------------------------------------------------------------------------
def test_synth_past_the_disk_is_refused_before_building_anything():
    t0 = time.monotonic()
    r = refuses(["synth", "--preset", "kimi-k2.6", "--layers", "100000", "--out", "/tmp/ddtree-synth-never"],
                "Error: ResourceError: ", "GiB of disk", "--out /tmp/ddtree-synth-never")
    assert time.monotonic() - t0 < 30, "the estimate built the tensor table"
    assert r.stdout == ""


def test_synth_past_the_memory_is_refused(monkeypatch, tmp_path):
    import ddtree.model.synth_cli as synth_cli
    monkeypatch.setattr(synth_cli, "available_memory", lambda: 10_000)          # 10 kB available
    r = CliRunner().invoke(main, ["synth", "--preset", "small-mla", "--out", str(tmp_path / "s")])
    assert r.exit_code == 1 and "Error: ResourceError: " in r.output and "GiB of memory" in r.output, r.output
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("preset, layers", [("tiny", None), ("small-mla", None), ("kimi-k2.6", 3), ("kimi-k2.6", 5)])
def test_the_estimate_equals_the_table(preset, layers):
    """target_size counts one layer per kind; the reference builds the whole table."""
    from ddtree.model.presets import get_preset
    from ddtree.model.synthetic import estimate
    from ddtree.model.tensors import drafter_tensor_specs, target_tensor_specs
    cfg, dcfg = get_preset(preset, layers)
    specs, drafter = target_tensor_specs(cfg), drafter_tensor_specs(dcfg)
    disk, memory = estimate(preset, layers)
    assert disk == sum(s.nbytes for s in [*specs.values(), *drafter.values()])
    assert memory == (len(specs) + len(drafter)) * 1024


# ---- closed readers and GPU-less benches --------------------------------------------------------------------
@pytest.mark.parametrize("args", [["bench", "project", "--budget", "8", "--context", "4096"], ["--help"]])
def test_output_into_a_closed_pipe_exits_141(args):
    """stdout a pipe whose reader is gone before the first write: rich's table (which exited 1) and click's
    help (printed before any command runs) both end with 141, quietly."""
    import os
    r_fd, w_fd = os.pipe()
    os.close(r_fd)
    try:
        r = subprocess.run([sys.executable, "-m", "ddtree", *args], stdout=w_fd, stderr=subprocess.PIPE, text=True,
                           timeout=120)
    finally:
        os.close(w_fd)
    assert r.returncode == 141 and r.stderr == "", (r.returncode, r.stderr)


def test_rich_output_into_head():
    r = shell('"$0" -m ddtree bench project --budget 8 --context 4096 | head -c 1 > /dev/null; '
              'echo "rc=${PIPESTATUS[0]}"')
    assert "Traceback" not in r.stderr and r.stdout.strip() in ("rc=0", "rc=141"), (r.stdout, r.stderr)


def test_bench_allreduce_without_a_gpu_is_one_line():
    from ddtree.runtime.cuda_executor import gpu_unavailable
    if gpu_unavailable(0) is None:
        pytest.skip("a GPU is present")
    line = one_line_error(ddtree(["bench", "allreduce", "--gpu", "0,1"]), "DeviceUnavailableError")
    assert "--gpu 0,1" in line


# ---- an error after partial text ------------------------------------------------------------------------------
@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_an_error_mid_stream_starts_its_own_line(monkeypatch, json_flag):
    from ddtree.errors import InputError
    from ddtree.runtime.engine import DDTreeEngine
    real = DDTreeEngine.stream

    def failing(self, *args, **kwargs):
        for i, chunk in enumerate(real(self, *args, **kwargs)):
            yield chunk
            if i == 1:
                raise InputError("the stream failed after two steps")
    monkeypatch.setattr(DDTreeEngine, "stream", failing)
    r = CliRunner().invoke(main, ["run", "Hello", "--max-new-tokens", "32", "--temperature", "1", *json_flag])
    assert r.exit_code == 1
    text = r.stderr if json_flag else r.stdout + r.stderr
    assert "\nError: InputError: the stream failed after two steps" in text, text
    assert not any(line.startswith("{") for line in r.stdout.splitlines())
