"""`ddtree bench e2e --prune auto [--prune-rate R]` (issue 53) on the CPU: the pruned row's target metric (committed
tokens per distinct expert read, before / after, and the relative changes) recomputed from the row's own fields, the
rate reaching the Pruner (prune_rate_source "given", nodes pruned at a rate that prunes), the columns in the printed
table, and --prune-rate without --prune auto refused by name."""
import json

import pytest
from click.testing import CliRunner
from rich.console import Console

from ddtree.bench.e2e import print_table, tokens_per_expert
from ddtree.builder.build import build_engine
from ddtree.cli import main
from ddtree.data import tiny_model_dirs

HIGH = 1e-4          # tokens per byte: with the tiny model's ~110 KB experts, any node with a marginal expert goes


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return build_engine(*tiny_model_dirs(), 1, [], tmp_path_factory.mktemp("e2e_prune") / "e", graphs=False,
                        kernels=False)["engine"]


def e2e(*args):
    return CliRunner().invoke(main, ["bench", "e2e", *args])


@pytest.fixture(scope="module")
def rows(engine):
    r = e2e("--model", str(engine), "--prune", "auto", "--budget", "16", "--max-new-tokens", "12", "--prune-rate",
            str(HIGH), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["prune_rate"] == HIGH
    return out["rows"]


def test_target_metric_is_recomputed_from_the_rows_fields(rows):
    off, on = rows[1], rows[2]
    assert (off["prune"], on["prune"]) == ("off", "auto") and on["prune_rate_source"] == "given"
    assert on["pruned_nodes"] > 0 and on["distinct_experts_after"] < on["distinct_experts_before"]
    assert on["accept_len_before"] == off["mean_accept_len"] and on["accept_len_after"] == on["mean_accept_len"]
    before = off["mean_accept_len"] / on["distinct_experts_before"]
    after = on["mean_accept_len"] / on["distinct_experts_after"]
    assert on["tokens_per_expert_before"] == pytest.approx(before, rel=1e-12)
    assert on["tokens_per_expert_after"] == pytest.approx(after, rel=1e-12)
    assert on["tokens_per_expert_gain"] == pytest.approx(after / before - 1, rel=1e-12, abs=1e-15)
    assert on["accept_len_change"] == pytest.approx(on["mean_accept_len"] / off["mean_accept_len"] - 1, rel=1e-12,
                                                    abs=1e-15)
    assert "tokens_per_expert_gain" not in off and "tokens_per_expert_gain" not in rows[0]


def test_metric_by_hand_and_zero_denominators():
    row = {"accept_len_before": 3.0, "accept_len_after": 2.91, "distinct_experts_before": 8.0,
           "distinct_experts_after": 6.0}
    m = tokens_per_expert(row)
    assert m["tokens_per_expert_before"] == pytest.approx(0.375) and m["tokens_per_expert_after"] == pytest.approx(0.485)
    assert m["tokens_per_expert_gain"] == pytest.approx(0.485 / 0.375 - 1) and m["accept_len_change"] == \
        pytest.approx(-0.03)
    zero = tokens_per_expert({**row, "distinct_experts_after": 0.0})
    assert zero["tokens_per_expert_after"] is None and zero["tokens_per_expert_gain"] is None


def test_printed_table_has_the_pruning_columns(rows):
    console = Console(record=True, width=400)
    print_table({"device": "cpu", "prompts": 1, "max_new_tokens": 12, "repeats": 1, "sampling": {"label": "greedy"},
                 "memory": None, "rows": rows}, console)
    text = console.export_text()
    for name in ("pruned a step", "experts before / after", "tok/expert gain", "accept len change"):
        assert name in text, text
    on = rows[2]
    assert f"{on['distinct_experts_before']:.2f} / {on['distinct_experts_after']:.2f}" in text
    assert f"{100 * on['tokens_per_expert_gain']:+.1f} %" in text and f"{100 * on['accept_len_change']:+.1f} %" in text
    assert text.count(" - ") >= 8                 # the AR and unpruned rows: "-" in the four pruning cells


def test_prune_rate_needs_prune_auto():
    r = e2e("--prune-rate", "1e-7")
    assert r.exit_code == 2 and "--prune-rate" in r.output and "--prune auto" in r.output, r.output
    r = e2e("--prune", "auto", "--prune-rate", "-1")
    assert r.exit_code == 2 and "--prune-rate" in r.output, r.output
