"""Hostile engine directories (issue 52, engine dirs): a huge config.json is refused on its size, before a
byte is read (its manifest size, or the cap on every engine JSON file when the manifest was rewritten to
match), and tuning.json is checked field by field by the one check `ddtree inspect` and `--budget auto`
share: for every edit with its checksum recomputed, both refuse it with the same message, or both take it
and auto runs."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from ddtree.cli import main
from ddtree.engine_dir import tuning_path, write_tuning
from ddtree.engine_dir.layout import MAX_JSON_BYTES
from ddtree.engine_dir.manifest import files_checksum
from ddtree.engine_dir.tuning import canonical_sha256
from tests.test_engine_tuning import make_tuning


@pytest.fixture
def engine(engine_dir, tmp_path):
    """A copy of the builder tests' tp 1 engine of the tiny preset (built once per session; the CPU runs it)."""
    copy = tmp_path / "engine"
    shutil.copytree(engine_dir(1), copy)
    return copy


def max_rss_mb_of(args: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """`python -m ddtree ARGS` and the peak resident memory of that process alone."""
    probe = ("import resource, subprocess, sys; r = subprocess.run([sys.executable, '-m', 'ddtree', *sys.argv[1:]], "
             "capture_output=True, text=True); print(r.returncode); print(resource.getrusage("
             "resource.RUSAGE_CHILDREN).ru_maxrss); sys.stderr.write(r.stderr)")
    r = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=120)
    code, rss_kb = r.stdout.split()[-2:]
    r.returncode = int(code)
    return r, int(rss_kb) / 1024


def grow(path, size: int) -> None:
    """path made `size` bytes without writing them (a sparse tail of zeros)."""
    os.truncate(path, size)


def relist(engine, rel: str) -> None:
    """manifest.json rewritten so that rel's size matches the file again (its sha256 left as built)."""
    m = json.loads((engine / "manifest.json").read_text())
    m["files"][rel]["size"] = (engine / rel).stat().st_size
    if "files_sha256" in m:
        m["files_sha256"] = files_checksum(m["files"])
    (engine / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("command", [["inspect"], ["run", "hi", "--max-new-tokens", "2", "--model"]])
def test_a_huge_config_is_refused_on_its_size(engine, command):
    grow(engine / "config.json", 1 << 30)
    r, rss = max_rss_mb_of([*command, str(engine)])
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "Error: EngineFormatError: " in r.stderr and f"config.json: size {1 << 30} bytes" in r.stderr
    assert rss < 600, f"{rss:.0f} MB resident: the file was read"


def test_a_huge_config_listed_at_its_size_is_refused_by_the_cap(engine):
    grow(engine / "config.json", MAX_JSON_BYTES + 1)
    relist(engine, "config.json")
    r, rss = max_rss_mb_of(["inspect", str(engine)])
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{MAX_JSON_BYTES + 1} bytes, more than any engine JSON file may be" in r.stderr
    assert rss < 400, f"{rss:.0f} MB resident: the file was read"


@pytest.mark.parametrize("name", ["manifest.json", "tuning.json"])
def test_other_huge_json_files_are_refused_by_the_cap(engine, name):
    write_tuning(engine, make_tuning())
    grow(engine / name, MAX_JSON_BYTES + 7)
    r, rss = max_rss_mb_of(["inspect", str(engine)])
    assert "Traceback" not in r.stderr and r.returncode == 1, r.stderr
    assert f"{MAX_JSON_BYTES + 7} bytes, more than any engine JSON file may be" in r.stderr
    assert rss < 400


def edited_tuning(engine, edit) -> None:
    """tuning.json with `edit` applied to its fields and its checksum recomputed (an edit made to pass)."""
    write_tuning(engine, make_tuning())
    d = json.loads(tuning_path(engine).read_text())
    d.pop("sha256")
    edit(d)
    d["sha256"] = canonical_sha256(d)
    tuning_path(engine).write_text(json.dumps(d))


def setter(path: str, value):
    def edit(d):
        keys = path.split(".")
        node = d
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        last = keys[-1]
        node[int(last) if isinstance(node, list) else last] = value
    return edit


REFUSED = [("budgets", [8, 16, 100000], "budgets"), ("budgets", [0, 16, 32], "budgets"),
           ("budgets", [32, 16, 8], "budgets"), ("budgets", [8, 16, 256], "budgets"),
           ("context_buckets", [], "context_buckets"), ("step_time_us.1.0", 0.0, "step_time_us"),
           ("step_time_us.1.0", -5.0, "step_time_us"), ("step_time_us.0.0", 5e-324, "step_time_us"),
           ("step_time_us.2", [1.0], "step_time_us"),
           ("expected_distinct_experts", [1.0], "expected_distinct_experts"),
           ("calibration.pooled.samples", "many", "samples"), ("calibration.pooled.samples", -1, "samples"),
           ("calibration.pooled.y", [0.0, 2.0], "calibration"), ("calibration.depths", "none", "calibration"),
           ("format", "ddtree-tuning/2", "format"), ("machine", "", "machine")]
ACCEPTED = [("budgets", [8, 16, 255]), ("step_time_us.0.0", 1e-3), ("step_time_us.2.1", 1.7976931348623157e308),
            ("context_buckets", [1, 2 ** 62]), ("expected_distinct_experts", [0, 0, 1e308])]


def inspect_problem(engine) -> str | None:
    r = CliRunner().invoke(main, ["inspect", str(engine), "--json"])
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.exit_code == (0 if info["ok"] else 1) and "Traceback" not in r.output
    return None if info["ok"] else "; ".join(info["problems"])


def run_auto(engine):
    return CliRunner().invoke(main, ["run", "def f", "--model", str(engine), "--budget", "auto",
                                     "--max-new-tokens", "6", "--json"])


@pytest.mark.parametrize("path, value, field", REFUSED)
def test_inspect_and_auto_refuse_the_same_edit(engine, path, value, field):
    edited_tuning(engine, setter(path, value))
    problem = inspect_problem(engine)
    assert problem is not None and problem.startswith("tuning.json: ") and field in problem, problem
    r = run_auto(engine)
    assert r.exit_code == 1 and r.exception is None or isinstance(r.exception, SystemExit), r.exception
    line = [x for x in r.stderr.splitlines() if x.startswith("Error: ")]
    assert len(line) == 1 and line[0].startswith("Error: TuningError: "), r.stderr
    assert line[0].endswith(problem.split("tuning.json: ", 1)[1])


@pytest.mark.parametrize("path, value", ACCEPTED)
def test_inspect_and_auto_take_the_same_edit(engine, path, value):
    edited_tuning(engine, setter(path, value))
    assert inspect_problem(engine) is None
    r = run_auto(engine)
    assert r.exit_code == 0, r.output
    stats = json.loads(r.stdout.strip().splitlines()[-1])["stats"]
    assert stats["new_tokens"] == 6
