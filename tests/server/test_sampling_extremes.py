"""Extreme finite values of every numeric sampling parameter, through `ddtree run` and `ddtree serve`
(issue 52, sampling). Each value is either refused naming its parameter (CLI: the one-line error, exit 1
or click's exit 2; server: a 400 before any stream) or served, and what is served is checked against an
independent reference: where a setting must reduce to greedy (top_k 1, top_p below every probability,
a temperature at the floor), the tokens equal the greedy ones while plain sampling at T = 1 does not."""
from __future__ import annotations

import json

import httpx
import pytest
from click.testing import CliRunner

from ddtree.cli import main
from ddtree.tree.sampling import MIN_TEMPERATURE
from tests.server.conftest import MODEL

PROMPT = "The quick brown fox"
N = 6
TINY = 5e-324                   # the smallest subnormal double
HUGE = 1.7976931348623157e308   # the largest finite double


def cli(*args: str):
    r = CliRunner().invoke(main, ["run", PROMPT, "--max-new-tokens", str(N), "--json", *args])
    return r.exit_code, r.stdout, r.stderr


def cli_tokens(*args: str) -> list[int]:
    code, out, err = cli(*args)
    assert code == 0, err
    return json.loads(out)["tokens"]


def served(url: str, stream: bool = False, **params) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": N, "seed": 0, **params, "stream": stream}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def served_text(url: str, **params) -> str:
    r = served(url, **params)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def greedy():
    return cli_tokens("--temperature", "0")


def test_the_reference_is_not_trivial(greedy):
    """Plain sampling at T = 1 (seed 0) differs from greedy: the 'equals greedy' checks below can fail."""
    assert cli_tokens("--temperature", "1") != greedy


@pytest.mark.parametrize("temperature", [TINY, 1e-310, 1e-300, 1e-30, MIN_TEMPERATURE * 0.999])
def test_cli_refuses_temperatures_below_the_floor(temperature):
    code, out, err = cli("--temperature", repr(temperature))
    assert code == 1 and out == ""
    assert err.startswith("Error: SamplingError: ") and "temperature" in err and err.count("\n") == 1


@pytest.mark.parametrize("args", [
    ("--temperature", repr(MIN_TEMPERATURE)), ("--temperature", "1", "--top-k", "1"),
    ("--temperature", "1", "--top-p", repr(TINY)), ("--temperature", repr(HUGE), "--top-k", "1"),
    ("--temperature", "0", "--top-k", str(2 ** 70)), ("--temperature", "0", "--top-p", repr(HUGE)),
])
def test_cli_settings_that_reduce_to_greedy(greedy, args):
    assert cli_tokens(*args) == greedy


@pytest.mark.parametrize("args", [
    ("--temperature", repr(HUGE)), ("--temperature", "1", "--top-k", str(2 ** 63)),
    ("--temperature", "1", "--seed", str(2 ** 64 - 1)), ("--temperature", "1", "--top-p", "1e-300"),
])
def test_cli_extremes_that_sample(args):
    assert len(cli_tokens(*args)) == N


@pytest.mark.parametrize("args", [
    ("--temperature", "1e309"), ("--temperature", "-5e-324"), ("--top-p", "0"), ("--top-p", "-1e-300"),
    ("--top-k", "-1"), ("--seed", str(2 ** 64)), ("--max-new-tokens", "0"), ("--budget", "0"),
])
def test_cli_refuses_out_of_range_flags_at_parse_time(args):
    code, out, err = cli(*args)
    assert code == 2 and out == "" and args[0] in err


def test_cli_huge_max_new_tokens_stops_at_the_context():
    result = CliRunner().invoke(main, ["run", "x" * 880, "--max-new-tokens", str(2 ** 70), "--json"])
    assert result.exit_code == 0, result.stderr
    stats = json.loads(result.stdout)["stats"]
    assert stats["finish_reason"] in ("length", "stop") and stats["new_tokens"] <= 896 - 880


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [TINY, 1e-310, 1e-300, MIN_TEMPERATURE * 0.999])
def test_server_refuses_temperatures_below_the_floor(server, stream, temperature):
    r = served(server, stream, temperature=temperature)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "temperature" and "at least 1e-06" in error["message"]


@pytest.mark.parametrize("params", [
    {"temperature": MIN_TEMPERATURE}, {"temperature": 1.0, "top_k": 1}, {"temperature": 1.0, "top_p": TINY},
    {"temperature": 2.0, "top_k": 1}, {"temperature": 0.0, "top_k": 2 ** 64}, {"temperature": 0.0, "top_k": -1},
])
def test_server_settings_that_reduce_to_greedy(server, engine, params):
    greedy = engine.tokenizer.decode(engine.generate(PROMPT, max_new_tokens=N).tokens)
    assert served_text(server, **params) == greedy


@pytest.mark.parametrize("params", [
    {"temperature": 2.0}, {"temperature": 1.0, "seed": 2 ** 64 - 1}, {"temperature": 1.0, "top_p": 1e-300},
    {"temperature": 1.0, "top_k": 2 ** 63},
])
def test_server_extremes_that_sample(server, params):
    r = served(server, **params)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == N, r.text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("params, param", [
    ({"temperature": HUGE}, "temperature"), ({"temperature": -TINY}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.0000000000000002}, "top_p"), ({"top_p": TINY * -1}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"seed": 2 ** 64}, "seed"), ({"seed": -1}, "seed"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -(2 ** 63)}, "max_tokens"),
])
def test_server_refuses_out_of_range_values_before_the_stream(server, stream, params, param):
    r = served(server, stream, **params)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_server_huge_max_tokens_stops_at_the_context(server):
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "x" * 880, "max_tokens": 2 ** 63,
                                                     "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert r.json()["usage"]["completion_tokens"] <= 896 - 880
