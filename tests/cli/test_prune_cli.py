"""--prune off|auto as a user meets it (issue 53): ddtree run / ddtree-run with --json on an engine dir (the stats
present, DDTree identical to AR under --mode both), ddtree serve answering with pruning on (the tokens the engine
commits without it), bench e2e's pruned rows beside the unpruned ones; refused by name where it cannot run (the
float64 reference of a checkpoint dir, the batching scheduler, bench e2e's --concurrency) and a bad value refused by
click."""
import json
from pathlib import Path

import httpx
import pytest

from ddtree.builder.build import build_engine
from ddtree.data import tiny_model_dirs
from ddtree.runtime.engine import DDTreeEngine
from tests.cli.bad_input import ddtree, refuses
from tests.server.conftest import live_server

STATS = ("pruned_nodes", "pruned_per_step", "distinct_experts_before", "distinct_experts_after", "prune_rate_source")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return build_engine(*tiny_model_dirs(), 1, [], tmp_path_factory.mktemp("prune_cli") / "e", graphs=False,
                        kernels=False)["engine"]


@pytest.mark.parametrize("ranks", ["processes", "threads"])
def test_run_json_stats_and_lossless(engine, ranks):
    r = ddtree(["run", "--model", str(engine), "--prune", "auto", "--budget", "8", "--max-new-tokens", "16",
                "--mode", "both", "--temperature", "0.8", "--ranks", ranks, "--json", "def f(x):"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["identical"] is True
    s = out["stats"]
    assert all(k in s for k in STATS) and len(s["pruned_per_step"]) == s["steps"]
    assert s["prune"] == "auto" and s["distinct_experts_after"] <= s["distinct_experts_before"]
    r = ddtree(["run", "--model", str(engine), "--max-new-tokens", "4", "--json", "def f(x):"])
    assert r.returncode == 0 and "pruned_nodes" not in json.loads(r.stdout.strip().splitlines()[-1])["stats"]


def test_refused_by_name():
    refuses(["run", "--prune", "auto", "hi"], "PruneRefused", "--prune auto", "numpy executor", "--prune off")
    refuses(["run", "--prune", "sometimes", "hi"], "--prune", "'off'", "'auto'", code=2)
    refuses(["serve", "--prune", "auto", "--port", "0"], "PruneRefused", "numpy executor")


def test_tp2_rank_processes_refuse(tmp_path):
    tp2 = build_engine(*tiny_model_dirs(), 2, [], tmp_path / "e2", graphs=False, kernels=False)["engine"]
    refuses(["run", "--model", str(tp2), "--prune", "auto", "hi"], "PruneRefused", "tp > 1 rank processes",
            "--ranks threads")


def test_serve_and_bench_refuse_what_does_not_prune(engine):
    refuses(["serve", "--model", str(engine), "--prune", "auto", "--max-num-seqs", "2", "--port", "0"],
            "--prune auto", "--max-num-seqs 2")
    refuses(["bench", "e2e", "--model", str(engine), "--prune", "auto", "--concurrency", "2"], "--prune",
            "--concurrency", code=2)


def test_serve_prunes_and_commits_the_unpruned_tokens(engine):
    want = DDTreeEngine.load(str(engine)).generate("def f(x):", max_new_tokens=12, budget=16)
    with live_server("--model", str(engine), "--prune", "auto") as (url, _):
        body = {"model": Path(engine).name, "prompt": "def f(x):", "max_tokens": 12, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want.text


def test_bench_e2e_rows(engine):
    r = ddtree(["bench", "e2e", "--model", str(engine), "--prune", "auto", "--budget", "4", "--max-new-tokens", "8",
                "--json"])
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout.strip().splitlines()[-1])["rows"]
    assert [(x["mode"], x["budget"], x.get("prune")) for x in rows] == [("ar", None, None), ("ddtree", 4, "off"),
                                                                        ("ddtree", 4, "auto")]
    off, on = rows[1], rows[2]
    assert on["accept_len_before"] == off["mean_accept_len"] and on["accept_len_after"] == on["mean_accept_len"]
    assert all(k in on for k in STATS) and on["identical"] and off["identical"]
