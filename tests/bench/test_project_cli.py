"""`ddtree bench project` (issue 21): its JSON (docs/interfaces.md sections 1, 10) and its refusals."""
import json

import pytest
from click.testing import CliRunner

from ddtree.bench.projection import HAND_SPLIT, KIMI_DFLASH_CARD, PRO_6000, TINY_MODEL
from ddtree.cli import main

PROJECTION_KEYS = {"target", "bandwidth_tbps", "bf16_tflops", "allreduce_model", "accept_len", "accept_source",
                   "step_ms", "tokens_per_s"}          # docs/interfaces.md section 10


def project(*args):
    return CliRunner().invoke(main, ["bench", "project", *args])


@pytest.fixture(scope="module")
def out():
    r = project("--budget", "4,16", "--context", "4096,32768", "--routing", "uniform,tree", "--reuse", "0.5,1",
                "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_json_has_one_row_per_context_budget_and_routing(out):
    assert out["bench"] == "project" and "projection" in out["device"]
    assert out["ceiling"] == {"bandwidth_tbps": PRO_6000.bandwidth_tbps, "bf16_tflops": PRO_6000.bf16_tflops}
    keys = [(r["context"], r["budget"], r["routing"], r["reuse"]) for r in out["rows"]]
    assert keys == [(c, b, r, p) for c in (4096, 32768) for b in (4, 16)
                    for r, p in (("uniform", None), ("tree", 0.5), ("tree", 1.0))]
    assert out["assumptions"]["kernel_classes"]["moe"]["fixed_us"] == HAND_SPLIT["moe"].fixed_us


def test_each_rows_projection_is_self_consistent(out):
    for r in out["rows"]:
        p = r["projection"]
        assert PROJECTION_KEYS <= set(p), PROJECTION_KEYS - set(p)
        assert p["target"] == "8x RTX PRO 6000" and p["accept_len"] == KIMI_DFLASH_CARD.constant
        assert p["tokens_per_s"] == pytest.approx(p["accept_len"] / (p["step_ms"] / 1e3))
        assert p["step_ms"] == pytest.approx(sum(p["split_ms"].values()))
        assert p["ideal_ms"] == pytest.approx(r["bytes"] / 1.79e9)
        assert sum(c["count"] for c in p["collectives"] if c["op"] == "all_reduce") == 1 + 2 * 61 + 2 + 2 * 6
        assert r["tree"]["nodes"] == r["budget"] + 1 == sum(r["tree"]["depth_histogram"])


def test_routing_changes_only_the_moe_bytes(out):
    rows = {(r["context"], r["budget"], r["routing"], r["reuse"]): r for r in out["rows"]}
    for c in (4096, 32768):
        for b in (4, 16):
            uniform, half, full = rows[c, b, "uniform", None], rows[c, b, "tree", 0.5], rows[c, b, "tree", 1.0]
            assert full["distinct_experts"] == {**full["distinct_experts"], "mean": 8, "min": 8, "max": 8}
            assert full["bytes"] < half["bytes"] < uniform["bytes"]
            for phase in ("attention", "dense", "lm_head", "drafter", "allreduce"):
                assert full["projection"]["split_ms"][phase] == pytest.approx(uniform["projection"]["split_ms"][phase])


def test_tiny_curve_is_labelled_and_table_prints():
    r = project("--budget", "4,8", "--context", "4096", "--routing", "uniform", "--accept", "tiny", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["rows"]
    assert [x["projection"]["accept_len"] for x in rows] == [TINY_MODEL.by_budget[4], TINY_MODEL.by_budget[8]]
    assert all("TINY" in x["projection"]["accept_source"] for x in rows)
    table = project("--budget", "4,8", "--context", "4096")
    assert table.exit_code == 0 and "PROJECTION" in table.stdout and "tokens/s" in table.stdout


def test_measured_rows_refit_their_class(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"rows": [{"kernel_class": "gemm", "bytes": b, "flops": 0, "us": 3.0 + b / 2.1e6}
                                         for b in (1e6, 1e7, 1e8)]}))
    r = project("--budget", "4", "--context", "4096", "--routing", "uniform", "--measured", str(path), "--json")
    assert r.exit_code == 0, r.output
    gemm = json.loads(r.stdout)["assumptions"]["kernel_classes"]["gemm"]
    assert gemm["fixed_us"] == pytest.approx(3.0) and gemm["efficiency"] == pytest.approx(2.1 / 4.2)
    assert str(path) in gemm["source"]


@pytest.mark.parametrize("args, names", [
    (["--budget", "0,4"], ["--budget", "1..255"]),
    (["--budget", "four"], ["--budget", "'four'"]),
    (["--context", "4096,x"], ["--context"]),
    (["--routing", "zipf"], ["--routing", "zipf", "uniform or tree"]),
    (["--routing", "tree", "--reuse", "1.5"], ["--reuse", "0.0..1.0", "1.5"]),
    (["--routing", "uniform", "--reuse", "-0.1"], ["--reuse", "0.0..1.0"]),
    (["--routing", "uniform", "--reuse", "0.5"], ["--reuse", "--routing tree only"]),
    (["--accept", "paper"], ["--accept", "paper"]),
])
def test_bad_flags_are_refused_naming_the_flag(args, names):
    r = project(*args, "--json")
    assert r.exit_code == 2 and not r.stdout and "Traceback" not in r.output
    for name in names:
        assert name in r.stderr, (name, r.stderr)


def test_bad_measured_file_is_an_error_naming_it(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": [{"kernel_class": "warp", "bytes": 1, "flops": 0, "us": 1}]}))
    r = project("--budget", "4", "--context", "4096", "--measured", str(bad))
    assert r.exit_code == 1 and "MeasuredRowsError" in r.stderr and str(bad) in r.stderr
    assert "kernel_class 'warp'" in r.stderr
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"rows": [{"kernel_class": "moe", "bytes": 1e6, "flops": 0, "us": 9}]}))
    r = project("--budget", "4", "--context", "4096", "--measured", str(one))
    assert r.exit_code == 1 and "'moe'" in r.stderr and "2 different byte counts" in r.stderr
