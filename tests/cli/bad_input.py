"""Running a command as a user would (a subprocess) and checking how it refuses bad input.

    r = refuses(["run", "--model", str(d), "hi"], "ConfigError", str(d / "config.json"), "rms_norm_eps", "nan")
A refusal exits 1 with one `Error: <Type>: <message>` line (ddtree/errors.py), no traceback, and a
message that names every given fragment (file, field, value, what was expected)."""
import os
import subprocess
import sys


def ddtree(args: list[str], stdin: str | bytes | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m ddtree ARGS` (ddtree-run is `ddtree run`), text mode unless stdin is bytes."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "ddtree", *args], input=stdin, capture_output=True, timeout=timeout,
                          env=env, text=not isinstance(stdin, bytes))


def refuses(args: list[str], error: str, *names: str, stdin=None, code: int = 1) -> subprocess.CompletedProcess:
    r = ddtree(args, stdin)
    err = r.stderr if isinstance(r.stderr, str) else r.stderr.decode(errors="replace")
    assert "Traceback" not in err, f"{args}: a traceback instead of an error:\n{err}"
    assert r.returncode == code, f"{args}: exit {r.returncode}, expected {code}:\n{err}"
    assert error in err, f"{args}: {error!r} not in:\n{err}"
    for name in names:
        assert name in err, f"{args}: the message does not name {name!r}:\n{err}"
    return r
