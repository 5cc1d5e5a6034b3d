"""bench step --baseline (bench/step_baseline.py): the options passed to the baseline tree, the subprocess running
THAT tree's package, rows paired by case with their speedups, and the refusals."""
import click
import pytest

from ddtree.bench.step import step_command
from ddtree.bench.step_baseline import (
    THIS_TREE,
    around,
    baseline_args,
    check_baseline,
    measure_around,
    pair_rows,
    run_baseline,
)
from tests.cli.bad_input import refuses


def test_only_options_off_their_defaults_reach_the_baseline():
    ctx = step_command.make_context("step", ["--budget", "16", "--routing", "tree", "--ar", "--no-prefetch-next",
                                             "--prune", "--baseline", "somewhere", "--baseline-around", "--json"])
    assert baseline_args(ctx) == ["--budget", "16", "--routing", "tree", "--ar", "--no-prefetch-next", "--prune"]
    assert baseline_args(step_command.make_context("step", ["--baseline", "x"])) == []


def test_the_baseline_runs_its_own_package(tmp_path):
    pkg = tmp_path / "ddtree"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text("import json, sys\nprint(json.dumps({'argv': sys.argv[1:], 'file': __file__}))\n")
    got = run_baseline(check_baseline(str(tmp_path)), ["--budget", "16"])
    assert got["argv"] == ["bench", "step", "--budget", "16", "--json"]
    assert got["file"].startswith(str(tmp_path.resolve()))              # not the ddtree under test
    (pkg / "__main__.py").write_text("import sys\nsys.exit('no such option: --prune-rate')\n")
    with pytest.raises(click.ClickException, match="exited 1: no such option"):
        run_baseline(tmp_path, [])
    with pytest.raises(click.BadParameter, match="no .*ddtree/__init__.py"):
        check_baseline(str(tmp_path / "missing"))


def _row(budget, us, pruned=False, moe=100.0):
    return {"context": 4096, "budget": budget, "routing": "tree", "reuse": 0.5, "collectives": "copy",
            "pruned": {"pruned_nodes": 3} if pruned else None, "step_us": us, "pct_roofline": 50.0, "kernels": 10,
            "parts": {"moe": {"us": moe, "overhead_us": moe / 2}}}


def test_rows_pair_by_case_with_their_speedups():
    base = {"device": "H100", "rows": [_row(16, 1200.0, moe=90.0), _row(16, 1000.0, pruned=True), _row(8, 700.0)]}
    rows = [_row(16, 1000.0), _row(16, 800.0, pruned=True), _row(32, 2000.0)]
    pair_rows(rows, base, "H100")
    assert rows[0]["baseline"]["step_us"] == 1200.0 and rows[0]["speedup_vs_baseline"] == pytest.approx(1.2)
    assert rows[0]["baseline"]["parts"] == {"moe": {"us": 90.0, "overhead_us": 45.0}}
    assert rows[1]["speedup_vs_baseline"] == pytest.approx(1.25)        # the pruned row with the pruned one
    assert "baseline" not in rows[2]                                    # a case the baseline did not run
    with pytest.raises(click.ClickException, match="one card"):
        pair_rows(rows, {**base, "device": "H200"}, "H100")


def test_around_pairs_each_row_with_the_mean_of_the_baselines_two_runs():
    """--baseline-around: 1200 us before and 1000 after this tree's rows -> 1100 (both kept, in run order), the
    parts and per-layer terms averaged, the roofline share of the mean step (the same ideal: 600 us); a case the
    second run lacks is not paired."""
    first = {"device": "H100", "copy_ceiling_gbps": 3000.0,
             "rows": [{**_row(16, 1200.0, moe=90.0), "pct_roofline": 50.0, "overhead_us_per_layer": 10.0},
                      _row(8, 700.0)]}
    second = {"device": "H100", "rows": [{**_row(16, 1000.0, moe=70.0), "pct_roofline": 60.0,
                                          "overhead_us_per_layer": 8.0}]}
    base = around(first, second)
    assert base["around"] and base["copy_ceiling_gbps"] == 3000.0
    assert len(base["rows"]) == 1
    b = base["rows"][0]
    assert b["step_us"] == 1100.0 and b["step_us_runs"] == [1200.0, 1000.0]
    assert b["parts"] == {"moe": {"us": 80.0, "overhead_us": 40.0}}
    assert b["overhead_us_per_layer"] == 9.0
    assert b["pct_roofline"] == pytest.approx(100 * 600.0 / 1100.0)
    rows = [_row(16, 1000.0), _row(8, 650.0)]
    pair_rows(rows, base, "H100")
    assert rows[0]["speedup_vs_baseline"] == pytest.approx(1.1)
    assert rows[0]["baseline"]["step_us_runs"] == [1200.0, 1000.0]
    assert "baseline" not in rows[1]
    with pytest.raises(click.ClickException, match="baseline ran on 'H100', then on 'H200'"):
        around(first, {**second, "device": "H200"})


def test_measure_around_runs_baseline_this_tree_baseline_as_subprocesses(tmp_path):
    """--baseline-around: three runs in order (baseline, this tree, baseline), none in this process; this tree's
    rows paired with the baseline's mean (1200 and 1000 -> 1100 against 880: 1.25x) and its `baseline` field set."""
    calls, steps = [], iter([1200.0, 880.0, 1000.0])

    def fake_run(tree, args, what="baseline"):
        calls.append((tree, what, args))
        return {"device": "H100", "copy_ceiling_gbps": 3000.0, "rows": [_row(16, next(steps))]}

    result = measure_around(tmp_path, ["--budget", "16"], run=fake_run)
    assert "variants" not in result
    assert [(t, w) for t, w, _ in calls] == [(tmp_path, "baseline"), (THIS_TREE, "this tree"), (tmp_path, "baseline")]
    assert all(a == ["--budget", "16"] for _, _, a in calls)
    assert (THIS_TREE / "ddtree" / "bench" / "step_baseline.py").is_file()
    row = result["rows"][0]
    assert row["step_us"] == 880.0 and row["speedup_vs_baseline"] == pytest.approx(1100.0 / 880.0)
    assert row["baseline"]["step_us_runs"] == [1200.0, 1000.0]
    assert result["baseline"] == {"dir": str(tmp_path), "device": "H100", "copy_ceiling_gbps": 3000.0, "around": True}


def test_measure_around_pairs_each_variant_with_the_same_baseline(tmp_path):
    """--variant trees run after the first baseline run and before this tree, each paired with the baseline's mean
    (1200 and 1000 -> 1100): a variant at 1000 us is 1.1x, one at 1250 0.88x; this tree's rows as without them."""
    a, b = tmp_path / "a", tmp_path / "b"
    calls, steps = [], iter([1200.0, 1000.0, 1250.0, 880.0, 1000.0])

    def fake_run(tree, args, what="baseline"):
        calls.append((tree, what))
        return {"device": "H100", "copy_ceiling_gbps": 3000.0, "rows": [_row(16, next(steps))]}

    result = measure_around(tmp_path, [], (a, b), run=fake_run)
    assert calls == [(tmp_path, "baseline"), (a, "variant"), (b, "variant"), (THIS_TREE, "this tree"),
                     (tmp_path, "baseline")]
    assert [v["dir"] for v in result["variants"]] == [str(a), str(b)]
    got = [v["rows"][0]["speedup_vs_baseline"] for v in result["variants"]]
    assert got == [pytest.approx(1.1), pytest.approx(1100.0 / 1250.0)]
    assert result["rows"][0]["speedup_vs_baseline"] == pytest.approx(1100.0 / 880.0)


def test_baseline_args_leave_out_the_variants():
    """The trees run by --baseline-around are given this run's options without --variant (nor --baseline)."""
    ctx = step_command.make_context("step", ["--budget", "16", "--baseline", str(THIS_TREE), "--baseline-around",
                                             "--variant", str(THIS_TREE), "--json"])
    assert baseline_args(ctx) == ["--budget", "16"]


def test_baseline_refusals():
    refuses(["bench", "step", "--baseline", "/nonexistent"], "--baseline", "ddtree package", code=2)
    refuses(["bench", "step", "--baseline", "/nonexistent", "--ranks", "all", "--tp", "2"], "--baseline",
            "--ranks one", code=2)
    refuses(["bench", "step", "--baseline-around"], "--baseline-around", "give --baseline DIR", code=2)
    refuses(["bench", "step", "--baseline", str(THIS_TREE), "--baseline-around", "--timeline", "/tmp/t"], "--timeline",
            "traces nothing", code=2)
    refuses(["bench", "step", "--baseline", str(THIS_TREE), "--variant", str(THIS_TREE)], "--variant",
            "give --baseline DIR --baseline-around", code=2)
    refuses(["bench", "step", "--baseline", str(THIS_TREE), "--baseline-around", "--variant", "/nonexistent"],
            "--variant", "ddtree package", code=2)
