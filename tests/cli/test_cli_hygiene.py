"""CLI hygiene, run as a user would (a subprocess): nan/inf float flags refused at parse time (exit 2,
the flag named), undecodable prompts named with their byte offset, a reader that goes away ends the
command quietly (exit 141, no traceback), bad --budget / --block-size named, and every command wraps
its body in ddtree.errors.reported (an InputError is `Error: <Type>: <message>`, exit 1)."""
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ddtree.cli import main
from ddtree.cli_types import EXIT_PIPE_CLOSED, FiniteFloatRange, PromptError
from ddtree.data import tiny_model_dirs
from ddtree.errors import InputError, reported
from ddtree.runtime.run_cli import _read_prompt
from tests.cli.bad_input import refuses
from tests.cli.command_tree import leaves

RUN = ["run", "--max-new-tokens", "4"]                       # the embedded tiny model, a few tokens


def no_traceback(r) -> str:
    err = r.stderr if isinstance(r.stderr, str) else r.stderr.decode(errors="replace")
    assert "Traceback" not in err and "Exception ignored" not in err, err
    return err


# ---- nan / inf: refused when the flags are parsed -------------------------------------------------------
@pytest.mark.parametrize("flag", ["--temperature", "--top-p"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_run_float_flags_refuse_non_finite(flag, value):
    refuses([*RUN, "hi", flag, value], f"Invalid value for '{flag}'", value, "not a finite number", code=2)


@pytest.mark.parametrize("args,flag", [
    (["bench", "accept", "--prompts", "1", "--attention-factor", "nan"], "--attention-factor"),
    (["synth", "--preset", "tiny", "--out", "{tmp}", "--shard-mb", "inf"], "--shard-mb"),
])
def test_other_float_flags_refuse_non_finite(args, flag, tmp_path):
    out = tmp_path / "never"
    refuses([a.replace("{tmp}", str(out)) for a in args], f"Invalid value for '{flag}'", "not a finite number",
            code=2)
    assert not out.exists()


def test_every_float_flag_of_every_command_is_finite():
    """No command declares a float flag that would take nan (click.FLOAT / FloatRange / type=float)."""
    floats = []
    for path, cmd in leaves(main, "ddtree"):
        for p in cmd.params:
            if isinstance(p.type, (click.types.FloatParamType, click.FloatRange)):
                floats.append(f"{path} {p.opts[0]}")
                assert isinstance(p.type, FiniteFloatRange), f"{path} {p.opts[0]} takes nan/inf"
    assert {"ddtree run --temperature", "ddtree run --top-p", "ddtree synth --shard-mb",
            "ddtree bench accept --attention-factor"} <= set(floats)


def test_finite_float_range_keeps_its_range():
    t = FiniteFloatRange(min=0.0, min_open=True)
    assert t.convert("0.25", None, None) == 0.25 and t.convert("1e308", None, None) == 1e308
    for bad, why in [("nan", "not a finite number"), ("-inf", "not a finite number"), ("0", "not in the range x>0"),
                     ("x", "not a valid float")]:
        with pytest.raises(click.BadParameter, match=why):
            t.convert(bad, None, None)


# ---- prompts that are not UTF-8 -------------------------------------------------------------------------
GOOD = "# café au lait\nprint('hi')\n".encode()
BAD = GOOD + b"\xff\xfe rest\n"                               # the first bad byte is at len(GOOD)


def test_undecodable_prompt_file_is_named(tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_bytes(BAD)
    refuses([*RUN, "--prompt-file", str(f)], "PromptError", str(f), f"byte {len(GOOD)}", "0xff", "UTF-8")


@pytest.mark.parametrize("args", [[], ["--prompt-file", "-"]])
def test_undecodable_stdin_is_named(args):
    refuses([*RUN, *args], "PromptError", "<stdin>", f"byte {len(GOOD)}", "0xff", stdin=BAD)


def test_undecodable_prompt_argument_is_named():
    arg = os.fsdecode(b"ab\xffc")                     # argv bytes that are not UTF-8 (surrogateescape)
    refuses([*RUN, arg], "PromptError", "PROMPT argument", "byte 2", "0xff")


def test_utf8_prompt_file_and_stdin_read_as_before(tmp_path):
    """The bytes path reads what text mode read: a file's \\r\\n become \\n, stdin is taken as is."""
    f = tmp_path / "p.txt"
    f.write_bytes(b"caf\xc3\xa9\r\nx")
    r = CliRunner().invoke(main, [*RUN, "--prompt-file", str(f), "--json", "--mode", "ar"])
    want = CliRunner().invoke(main, [*RUN, "café\nx", "--json", "--mode", "ar"])
    assert r.exit_code == 0 and want.exit_code == 0, (r.output, want.output)
    assert json.loads(r.stdout.splitlines()[-1])["tokens"] == json.loads(want.stdout.splitlines()[-1])["tokens"]
    f.write_bytes(b"caf\xe9")
    with open(f, "rb") as fh, pytest.raises(PromptError, match=r"p\.txt: not valid UTF-8 at byte 3 \(0xe9"):
        _read_prompt(None, fh)


# ---- a reader that goes away ----------------------------------------------------------------------------
def closed_reader(args: list[str]) -> subprocess.CompletedProcess:
    """Run `python -m ddtree ARGS` with stdout a pipe whose reading end is closed before it starts."""
    r_fd, w_fd = os.pipe()
    os.close(r_fd)
    try:
        p = subprocess.run([sys.executable, "-m", "ddtree", *args], stdout=w_fd, stderr=subprocess.PIPE,
                           stdin=subprocess.DEVNULL, text=True, timeout=300)
    finally:
        os.close(w_fd)
    return p


@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_run_into_a_closed_pipe_ends_quietly(extra):
    r = closed_reader([*RUN, "def f", *extra])
    no_traceback(r)
    assert r.returncode == EXIT_PIPE_CLOSED == 141, r.stderr


def test_run_piped_into_head():
    """`ddtree run ... | head -c 1`: ddtree's own exit status is 0 (done before head left) or 141."""
    r = subprocess.run(["bash", "-c", '"$0" -m ddtree run "def fib(n):" --max-new-tokens 48 | head -c 1; '
                        'exit ${PIPESTATUS[0]}', sys.executable], capture_output=True, timeout=300)
    no_traceback(r)
    assert r.returncode in (0, 141) and len(r.stdout) == 1, r.stderr


def test_run_with_stdout_closed_writes_nowhere():
    r = subprocess.run(["sh", "-c", '"$0" -m ddtree run "def f" --max-new-tokens 4 >&-', sys.executable],
                       capture_output=True, text=True, timeout=300)
    no_traceback(r)
    assert r.returncode == 0 and "4 new tokens" in r.stderr


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from ddtree.builder.build import build_engine
    from ddtree.builder.output_dir import BuildError
    from ddtree.model.synthetic import synth
    root = tmp_path_factory.mktemp("hygiene-engine")
    ckpt = synth(root / "ckpt", "tiny", seed=3)
    try:
        return Path(build_engine(*ckpt, 1, ["sm_120"], root / "engine", graphs=False)["engine"])
    except BuildError as e:
        pytest.skip(f"no engine without NVRTC: {e}")


def test_inspect_json_into_a_closed_pipe_ends_quietly(engine):
    r = closed_reader(["inspect", str(engine), "--json"])
    no_traceback(r)
    assert r.returncode == 141, r.stderr


# ---- bad budget / block size, and every command reports InputError ---------------------------------------
def drafter_block_size() -> int:
    return json.loads((Path(tiny_model_dirs()[1]) / "config.json").read_text())["block_size"]


@pytest.mark.parametrize("args,names", [
    (["--budget", "0"], ["'--budget'", "0"]),
    (["--budget", "256"], ["'--budget'", "256"]),
    (["--block-size", "1"], ["'--block-size'", "1"]),
    (["--block-size", "99"], ["--block-size", "99", "block_size {b}"]),
])
def test_bad_budget_and_block_size_are_named(args, names):
    names = [n.format(b=drafter_block_size()) for n in names]
    refuses([*RUN, "hi", *args], "Invalid value for", *names, code=2)


def test_device_without_a_runtime_is_a_named_error():
    refuses([*RUN, "hi", "--device", "cuda"], "DeviceUnavailableError", "--device", "'cuda'", "not available")


def test_build_reports_its_input_errors_by_type(tmp_path):
    target, drafter = tiny_model_dirs()
    r = CliRunner().invoke(main, ["build", "--model", str(target), "--drafter", str(drafter), "--arch", "sm_120",
                                  "--out", str(tmp_path / "e"), "--budget", "0"])
    assert r.exit_code == 1 and "Error: BuildError: --budget" in r.output, r.output


def test_every_command_wraps_its_body_in_reported():
    """Each leaf command's callback is the `reported()` wrapper (`@reported()` under its options), or its
    body runs `with reported():`: an InputError it raises is reported, not a traceback."""
    reported_func = reported.__wrapped__                      # the generator behind @contextmanager
    for _, cmd in leaves(main, "ddtree"):
        cells = [c.cell_contents for c in (cmd.callback.__closure__ or ())]
        decorated = any(getattr(c, "func", None) is reported_func for c in cells)
        assert decorated or "with reported():" in inspect.getsource(cmd.callback), f"{cmd.name}: not in reported()"


def test_sampling_and_request_errors_are_input_errors():
    from ddtree.runtime.engine import DDTreeEngine, RequestError
    from ddtree.tree.sampling import SamplingParams
    for kw, flag in [({"temperature": float("nan")}, "--temperature"), ({"top_p": float("inf")}, "--top-p"),
                     ({"top_k": -1}, "--top-k"), ({"seed": -1}, "--seed"), ({"temperature": "hot"}, "--temperature")]:
        with pytest.raises(InputError, match=flag):
            SamplingParams(**kw)
    with pytest.raises(RequestError, match="--device"):
        DDTreeEngine.load(device="tpu")
    with pytest.raises(NotImplementedError, match="--device"):               # still what it was for callers
        DDTreeEngine.load(device="cuda")


def test_comma_lists_one_rule():
    """ddtree/cli_types.comma_list, the one parser of every comma-separated flag: values in order, a bad item,
    an empty list or a value out of range is a BadParameter naming the flag."""
    import click

    from ddtree.cli_types import comma_list
    assert comma_list("4, 16,64", "--budget", int, 1, 255) == [4, 16, 64]
    assert comma_list("0,0.5", "--reuse", float, 0.0, 1.0) == [0.0, 0.5]
    for text, kw, why in (("4,x", {}, "comma-separated list of integers"), (",", {}, "at least one"),
                          ("0,4", {"lo": 1, "hi": 255}, "must be in 1..255")):
        with pytest.raises(click.BadParameter, match=why) as e:
            comma_list(text, "--budget", int, **kw)
        assert e.value.param_hint == "--budget"
