"""Every command of README.md works as written (issue 47 item 5; CPU, about 15 s on 2 cores).

The README's fenced bash blocks run here through bash, as pasted, with three changes only: `ddtree`, `ddtree-run`
and `ddtree-build` are this checkout's commands (`python3 -m ddtree ...` with the repository first on the path,
since the console scripts may point at another install), the serve snippet's port is a free one, and /tmp/synth is
a temporary folder. What a test cannot run is checked against CI: the install line of the test command must
install exactly the extras `.ci/run` installs, and `.ci/run` must run the same pytest. Every README command is
listed in EXERCISED with what exercises it, and a command missing there fails `test_every_command_is_exercised`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import ddtree

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CI_RUN = (ROOT / ".ci" / "run").read_text(encoding="utf-8")

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
MAIN_JOB = 'python3 -m pip install -e . && ddtree-run "def fib(n):"'
TESTS = "python3 -m pip install -e '.[dev,serve,train,cuda,graphs,trt,nccl]' && python3 -m pytest -q"


def blocks() -> list[str]:
    return [body for _, body in FENCE.findall(README)]


def commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, trailing '  # comments' dropped."""
    joined = re.sub(r"\\\n\s*", "", block)
    return [re.sub(r"\s+#\s.*$", "", line).strip() for line in joined.splitlines() if line.strip()]


def block_with(command: str) -> str:
    found = [b for b in blocks() if command in commands(b)]
    assert len(found) == 1, f"README has {len(found)} blocks with {command!r}"
    return found[0]


# README command -> what exercises it (a test of this file, or CI).
EXERCISED = {
    MAIN_JOB: "test_main_job (the ddtree-run part); .ci/run installs the package editable, "
              "tests/cli/test_base_install.py that the base install suffices",
    TESTS: "test_test_command_is_what_ci_runs",
    "ddtree serve --port 8000 & server=$!": "test_serve_snippet",
    "until curl -sf localhost:8000/health; do sleep 0.5; done": "test_serve_snippet",
    "curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' "
    "-d '{\"model\": \"ddtree-tiny\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"max_tokens\": 32}'":
        "test_serve_snippet",
    "kill $server": "test_serve_snippet",
    "ddtree synth --preset tiny --out /tmp/synth": "test_more_to_try",
    'ddtree-run --model /tmp/synth/target --drafter /tmp/synth/drafter "def fib(n):" --mode both --max-new-tokens 32 --json':
        "test_more_to_try",
    "ddtree bench project --budget 16 --context 4096": "test_more_to_try",
    "ddtree --version": "test_more_to_try",
}


def test_every_block_is_bash():
    langs = [lang for lang, _ in FENCE.findall(README)]
    assert langs and all(lang == "bash" for lang in langs), f"README fences must be bash blocks, got {langs}"


def test_every_command_is_exercised():
    found = [c for b in blocks() for c in commands(b)]
    missing = [c for c in found if c not in EXERCISED]
    assert not missing, "README commands no test runs (add them to EXERCISED and run them):\n" + "\n".join(missing)
    stale = [c for c in EXERCISED if c not in found]
    assert not stale, f"EXERCISED lists commands the README no longer has: {stale}"


def test_readme_is_a_front_door():
    assert len(README.splitlines()) <= 200
    assert README.count("\n| capability |") == 1                  # one status table


def test_test_command_is_what_ci_runs():
    extras = lambda text: set(re.search(r"pip install (?:-q )?-e '\.\[([\w,]+)\]'", text).group(1).split(","))  # noqa
    assert extras(TESTS) == extras(CI_RUN), "README's test command must install exactly .ci/run's extras"
    assert TESTS in commands(block_with(TESTS))
    assert re.search(r"^python -m pytest -q$", CI_RUN, re.M), ".ci/run no longer runs `pytest -q`"


@pytest.fixture
def shell(tmp_path):
    """run(script, timeout) -> CompletedProcess: bash with this checkout's ddtree commands first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, sub in (("ddtree", ""), ("ddtree-run", " run"), ("ddtree-build", " build")):
        path = bin_dir / name
        path.write_text(f'#!/usr/bin/env bash\nexec "{sys.executable}" -m ddtree{sub} "$@"\n')
        path.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    def run(script: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", "set -e\n" + script], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=timeout)
    return run


def test_main_job(shell):
    block = block_with(MAIN_JOB)
    assert block.strip() == MAIN_JOB
    r = shell(MAIN_JOB.split(" && ", 1)[1], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip(), "ddtree-run printed no text"
    assert "new tokens" in r.stderr and "finish reason" in r.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_snippet(shell):
    pytest.importorskip("fastapi", reason="ddtree serve needs the 'serve' extra")
    pytest.importorskip("uvicorn", reason="ddtree serve needs the 'serve' extra")
    if shutil.which("curl") is None:
        pytest.skip("the snippet uses curl, which this machine lacks")
    block = block_with("kill $server")
    assert block.count("8000") == 3
    port = free_port()
    r = shell(block.replace("8000", str(port)), timeout=120)        # returns once the server has exited
    assert r.returncode == 0, r.stderr[-3000:]
    answer = json.loads(r.stdout[r.stdout.index('{"id"'):].splitlines()[0])
    assert answer["object"] == "chat.completion" and answer["model"] == "ddtree-tiny"
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert 1 <= answer["usage"]["completion_tokens"] <= 32
    assert "drained, exiting" in r.stderr                            # kill sent SIGTERM, the server drained
    with socket.socket() as s:                                       # and the port is free again
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_more_to_try(shell, tmp_path):
    block = block_with("ddtree --version")
    r = shell(block.replace("/tmp/synth", str(tmp_path / "synth")), timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "synth" / "target" / "config.json").is_file()
    run = json.loads(next(line for line in r.stdout.splitlines() if line.startswith('{"text"')))
    assert run["identical"] is True and run["stats"]["new_tokens"] == run["ar"]["new_tokens"] > 0
    assert "PROJECTION" in r.stdout and "tokens/s" in r.stdout
    assert r.stdout.strip().splitlines()[-1] == f"ddtree, version {ddtree.__version__}"
