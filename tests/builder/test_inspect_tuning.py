"""`ddtree inspect` with a tuning file beside the engine: shown, not an unlisted file to the manifest
check or the load-time check, and an edited one named as a problem."""
import json
import shutil

from click.testing import CliRunner

from ddtree.cli import main
from ddtree.engine_dir import check_engine, tuning_path, write_tuning
from tests.test_engine_tuning import make_tuning


def inspect_json(engine):
    r = CliRunner().invoke(main, ["inspect", str(engine), "--json"])
    return r, json.loads(r.stdout.strip().splitlines()[-1])


def test_inspect_shows_the_tuning_and_names_an_edit(engine_dir, tmp_path):
    engine = tmp_path / "tuned"
    shutil.copytree(engine_dir(1), engine)
    r, info = inspect_json(engine)
    assert r.exit_code == 0 and info["tuning"] is None and "tuning   none" in r.stderr
    t = make_tuning()
    write_tuning(engine, t)
    check_engine(engine)                                       # loading: tuning.json is not an unlisted file
    r, info = inspect_json(engine)
    assert r.exit_code == 0, r.output
    assert info["ok"] and info["tuning"] == t.fields()
    assert "tuning   NVIDIA H200, 2026-11-30T23:00:00Z" in r.stderr and "1300.0" in r.stderr
    d = json.loads(tuning_path(engine).read_text())
    d["machine"] = "NVIDIA B200"
    tuning_path(engine).write_text(json.dumps(d))
    r, info = inspect_json(engine)
    assert r.exit_code == 1 and not info["ok"] and info["tuning"] is None
    assert len(info["problems"]) == 1
    assert info["problems"][0].startswith("tuning.json: its fields do not match its checksum")
