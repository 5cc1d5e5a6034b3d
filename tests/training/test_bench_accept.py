"""`ddtree bench accept --json` on a reduced run of the shipped model: schema and invariants."""
import json

from click.testing import CliRunner

from ddtree.bench.accept import distinct_ngram_fraction
from ddtree.cli import main


def test_accept_json_schema_reduced_run():
    res = CliRunner().invoke(main, ["bench", "accept", "--budget", "1,4", "--max-new-tokens", "12",
                                    "--prompts", "2", "--json"])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout.strip().splitlines()[-1])
    assert obj["bench"] == "accept" and isinstance(obj["device"], str)
    b = obj["config"]["block_size"]
    assert obj["ceiling"] == {"max_accept_len": b}
    assert [r["budget"] for r in obj["rows"]] == [1, 4]
    for r in obj["rows"]:
        assert 1.0 <= r["mean_accept_len"] <= b
        assert r["identical_to_ar"] is True and r["identical_prompts"] == 2      # DDTree == AR, greedy
        assert len(r["per_depth_accept_rate"]) == b - 1
        assert r["new_tokens"] == 2 * 12 and r["steps"] >= 1
    assert obj["rows"][0]["per_depth_accept_rate"][1] == 0.0                   # budget 1: a chain of one
    g = obj["generation"]
    assert g["prompts"] == 2 and g["ar_new_tokens"] == 24 and 0 < g["distinct_8gram_fraction_min"] <= 1


def test_bad_budgets_are_named():
    res = CliRunner().invoke(main, ["bench", "accept", "--budget", "0,300", "--json"])
    assert res.exit_code != 0 and "--budget" in res.output


def test_distinct_ngram_fraction():
    assert distinct_ngram_fraction(list(range(20))) == 1.0
    assert distinct_ngram_fraction([1, 2] * 20, n=8) == 2 / 33
    assert distinct_ngram_fraction([1, 2, 3]) == 1.0
