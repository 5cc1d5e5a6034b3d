"""`ddtree-run` end to end on a synthetic checkpoint, its JSON schema, and its flag errors."""
import json

import pytest
from click.testing import CliRunner

from ddtree.cli import main
from ddtree.model.synthetic import synth
from ddtree.runtime.engine import DDTreeEngine

STATS = {"new_tokens": int, "steps": int, "mean_accept_len": float, "per_depth_accept_rate": list,
         "tokens_per_s": float, "wall_s": float, "finish_reason": str}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target, drafter = synth(tmp_path_factory.mktemp("run"), "tiny", seed=5)
    return ["--model", str(target), "--drafter", str(drafter)]


def run(args, input=None):
    return CliRunner().invoke(main, ["run", *args], input=input)


def check_stats(stats):
    assert set(stats) == set(STATS)
    for key, typ in STATS.items():
        assert isinstance(stats[key], typ), key


@pytest.mark.parametrize("extra", [[], ["--temperature", "0.8", "--top-k", "50", "--top-p", "0.9", "--seed", "3"]])
def test_mode_both_json(dirs, extra):
    r = run([*dirs, "def fib(n):", "--mode", "both", "--json", "--max-new-tokens", "24", "--budget", "8", *extra])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out) == {"text", "tokens", "stats", "ar", "identical"}
    assert out["identical"] is True and len(out["tokens"]) == 24
    check_stats(out["stats"])
    check_stats(out["ar"])
    assert out["stats"]["new_tokens"] == 24 and len(out["stats"]["per_depth_accept_rate"]) == 3
    assert out["stats"]["finish_reason"] == out["ar"]["finish_reason"] == "length"      # 24 tokens, no EOS
    assert out["stats"]["steps"] * out["stats"]["mean_accept_len"] == pytest.approx(23)   # + the prefill token
    assert "identical: True" in r.stderr


def test_stdin_prompt_file_and_streamed_text(dirs, tmp_path):
    engine = DDTreeEngine.load(dirs[1], dirs[3])
    want = engine.generate("hello", max_new_tokens=12, budget=4)
    r = run([*dirs, "--max-new-tokens", "12", "--budget", "4"], input="hello")
    assert r.exit_code == 0, r.output
    assert r.stdout.rstrip("\n") == want.text           # the streamed text is the decoded result
    f = tmp_path / "p.txt"
    f.write_text("hello")
    r2 = run([*dirs, "--max-new-tokens", "12", "--budget", "4", "--prompt-file", str(f), "--json"])
    assert json.loads(r2.stdout.strip().splitlines()[-1])["tokens"] == want.tokens
    chunks = list(engine.stream("hello", max_new_tokens=12, budget=4))
    assert [t for c in chunks for t in c] == want.tokens and len(chunks) >= 2


@pytest.mark.parametrize("args,message", [
    (["--budget", "0"], "--budget"),
    (["--budget", "256"], "--budget"),
    (["--temperature", "-0.5"], "--temperature"),
    (["--block-size", "9"], "above the drafter's block_size 4"),
    (["--device", "cuda", "--gpu", "99"], "'cuda' is not available"),      # no driver here; no GPU 99 anywhere
    (["--mode", "fast"], "--mode"),
])
def test_bad_flags(dirs, args, message):
    r = run([*dirs, "x", *args])
    assert r.exit_code != 0 and message in r.output, r.output


def test_prompt_and_prompt_file_together_is_an_error(dirs):
    r = run([*dirs, "x", "--prompt-file", "-"])
    assert r.exit_code != 0 and "not both" in r.output
