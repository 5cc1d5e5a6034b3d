"""tuning.json (engine_dir/tuning.py): written and read back, its own checksum catching an edit, each
bad field named with the file, outside the manifest, and the step-time row for a context."""
import hashlib
import json

import numpy as np
import pytest

from ddtree import engine_dir as ed
from ddtree.engine_dir import Tuning, TuningError, read_tuning, tuning_path, write_tuning
from ddtree.tree.budget import choose_budget, fit_calibration


def make_tuning() -> Tuning:
    rng = np.random.default_rng(0)
    p = rng.random(3000)
    depth = rng.integers(1, 4, 3000)
    cal = fit_calibration(p, rng.random(3000) < p, depth)
    return Tuning("NVIDIA H200", "2026-11-30T23:00:00Z", (8, 16, 32), (1024, 8192),
                  ((900.0, 1000.0), (950.0, 1100.0), (1300.0, 1500.0)), (40.5, 61.25, 90.0), cal)


@pytest.fixture
def engine(tmp_path):
    """The least an engine is to the tuning file: a config.json with the engine format, and a manifest."""
    ed.config_path(tmp_path).write_text(json.dumps({"format": ed.ENGINE_FORMAT}))
    ed.write_manifest(tmp_path)
    return tmp_path


def test_round_trip_and_checksum(engine):
    t = make_tuning()
    path = write_tuning(engine, t)
    assert path == engine / "tuning.json" == tuning_path(engine)
    d = json.loads(path.read_text())
    rest = {k: v for k, v in d.items() if k != "sha256"}
    assert d["sha256"] == checksum(rest)
    back = read_tuning(engine)
    assert back.fields() == t.fields() == rest
    p = np.linspace(0, 1, 11)
    assert np.array_equal(back.calibration.calibrate(p, 2), t.calibration.calibrate(p, 2))


def test_outside_the_manifest(engine):
    write_tuning(engine, make_tuning())
    assert "tuning.json" not in ed.engine_files(engine)
    assert ed.verify_manifest(engine) == []                    # not "present but not listed"
    (engine / "stray.bin").write_bytes(b"x")                   # (the check still sees other files)
    assert ed.verify_manifest(engine) == ["stray.bin: present but not listed in manifest.json"]


def test_an_edit_is_named_as_an_edit(engine):
    path = write_tuning(engine, make_tuning())
    d = json.loads(path.read_text())
    d["step_time_us"][0][0] = 1.0                              # a hand-tuned "faster" budget
    path.write_text(json.dumps(d))
    with pytest.raises(TuningError, match=r"tuning.json: its fields do not match its checksum .* edited or damaged"):
        read_tuning(engine)
    path.write_text("{not json")
    with pytest.raises(TuningError, match=r"tuning.json: not JSON"):
        read_tuning(engine)
    path.unlink()
    with pytest.raises(TuningError, match=r"tuning.json: missing \(`ddtree tune"):
        read_tuning(engine)


def checksum(fields: dict) -> str:
    """Independent of the module: sha256 of the canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def rechecksummed(d: dict) -> dict:
    """An edited file with its checksum recomputed: only the field checks can catch it."""
    rest = {k: v for k, v in d.items() if k != "sha256"}
    return {**rest, "sha256": checksum(rest)}


@pytest.mark.parametrize("field,value,says", [
    ("budgets", [16, 8, 32], "field 'budgets' must be a non-empty increasing list of positive ints"),
    ("context_buckets", [], "field 'context_buckets' must be a non-empty increasing"),
    ("step_time_us", [[900.0, 1000.0], [950.0, -1.0], [1.0, 2.0]], "'step_time_us' must be [3 budgets][2 context"),
    ("step_time_us", [[900.0], [950.0], [1.0]], "field 'step_time_us' must be [3 budgets][2 context"),
    ("expected_distinct_experts", [1.0, 2.0], "field 'expected_distinct_experts' must be a list of 3 numbers"),
    ("machine", "", "field 'machine' must be a non-empty string"),
    ("format", "ddtree-tuning/0", "field 'format' must be 'ddtree-tuning/1'"),
    ("calibration", {"depths": [], "pooled": {"x": [0.5, 0.2], "y": [0.1, 0.2], "samples": 3}},
     "field calibration.pooled: x must be non-decreasing"),
    ("extra", 1, "unknown field 'extra'"),
])
def test_each_bad_field_is_named(engine, field, value, says):
    path = write_tuning(engine, make_tuning())
    d = json.loads(path.read_text())
    d[field] = value
    path.write_text(json.dumps(rechecksummed(d)))
    with pytest.raises(TuningError) as e:
        read_tuning(engine)
    assert str(e.value).startswith(f"{path}: ") and says in str(e.value)
    del d[field]
    if field != "extra":
        path.write_text(json.dumps(rechecksummed(d)))
        with pytest.raises(TuningError, match=f"missing field '{field}'"):
            read_tuning(engine)


def test_write_refuses_a_non_engine_and_a_bad_tuning(tmp_path, engine):
    with pytest.raises(ed.EngineFormatError, match="not an engine directory"):
        write_tuning(tmp_path / "nothing", make_tuning())
    t = make_tuning()
    bad = Tuning(t.machine, t.created, (8, 16, 32), t.context_buckets, t.step_time_us[:2], t.expected_distinct_experts,
                 t.calibration)
    with pytest.raises(TuningError, match="step_time_us"):
        write_tuning(engine, bad)
    assert not tuning_path(engine).exists()


def test_step_times_at_a_context_feed_the_choice():
    t = make_tuning()
    assert t.bucket_of(1) == 1024 and t.bucket_of(1024) == 1024 and t.bucket_of(1025) == 8192
    assert t.bucket_of(10**6) == 8192                          # past the last bucket: the last
    assert t.step_times_at(5000) == {8: 1000.0, 16: 1100.0, 32: 1500.0}
    e = np.interp(np.arange(33), [0, 8, 16, 32], [1.0, 4.0, 4.6, 5.0])
    # at 1024: 4/900 = .00444, 4.6/950 = .00484, 5/1300 = .00385 -> 16
    assert choose_budget(e, t.step_times_at(100), t.budgets) == 16
