"""Every command speaks the same dialect (issue 47 item 6; CPU only, no extras):

  - `--version` works on every entry point of pyproject.toml and on every group and subcommand under them, and
    prints the package version, which is pyproject.toml's;
  - one spelling per concept: no command spells a flag another command spells differently (--model, not --target;
    --budget, not --budgets; --prompts N, not --num-prompts; --gpu, not --gpus);
  - ddtree-run's and ddtree serve's sampling defaults, read from the click options and the pydantic request
    models, are the values SAMPLING_DEFAULTS states, and both --help texts end with it.
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import ddtree
from ddtree.cli import main
from ddtree.cli_types import SAMPLING_DEFAULTS
from tests.cli import command_tree

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = (ROOT / "pyproject.toml").read_text(encoding="utf-8")


def entry_points() -> dict[str, click.Command]:
    """pyproject.toml [project.scripts]: name -> the click command it runs."""
    section = PYPROJECT.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    out = {}
    for name, target in re.findall(r'^([\w-]+)\s*=\s*"([\w.:]+)"', section, re.M):
        module, attr = target.split(":")
        out[name] = getattr(importlib.import_module(module), attr)
    return out


def every_command() -> list[tuple[str, click.Command]]:
    """(path, command) for each entry point and every group and subcommand under it, the lazy ones loaded."""
    return [found for name, cmd in entry_points().items() for found in command_tree.every_command(cmd, name)]


def flags(cmd: click.Command) -> set[str]:
    return {o for p in cmd.params if isinstance(p, click.Option) for o in p.opts + p.secondary_opts
            if o.startswith("--") and o not in ("--help", "--version")}


def test_entry_points_are_the_three_commands():
    assert set(entry_points()) == {"ddtree", "ddtree-run", "ddtree-build"}
    paths = {p for p, _ in every_command()}                   # the walk finds the groups' subcommands too
    assert {"ddtree bench", "ddtree bench step", "ddtree serve", "ddtree run", "ddtree-run", "ddtree-build"} <= paths


def test_package_version_is_pyprojects():
    """pyproject.toml takes its version from ddtree/version.py (one place), and the installed metadata says it."""
    from importlib.metadata import version
    assert re.search(r'^dynamic\s*=\s*\["version"\]', PYPROJECT, re.M)
    assert re.search(r'^version\s*=\s*\{attr\s*=\s*"ddtree\.version\.__version__"\}', PYPROJECT, re.M)
    assert ddtree.__version__ == version("ddtree")


@pytest.mark.parametrize("path, cmd", every_command(), ids=[p for p, _ in every_command()])
def test_version_on_every_command(path, cmd):
    r = CliRunner().invoke(cmd, ["--version"], prog_name=path)
    assert r.exit_code == 0, r.output
    assert r.output.strip() == f"ddtree, version {ddtree.__version__}"


# Spellings a command once used, or a user might expect, for a concept another command already names.
SYNONYMS = {
    "--model": ["--target", "--engine", "--engine-dir", "--model-dir", "--checkpoint"],
    "--budget": ["--budgets", "--tree-budget", "--nodes"],
    "--prompts": ["--num-prompts", "--n-prompts", "--prompt-count"],
    "--prompt-file": ["--prompts-file", "--prompt-path"],
    "--gpu": ["--gpus", "--device-id", "--gpu-id"],
    "--max-new-tokens": ["--max-tokens", "--new-tokens"],
    "--context": ["--contexts", "--max-len"],
    "--temperature": ["--temp"],
    "--seed": ["--seeds"],
}


def all_flags() -> dict[str, list[str]]:
    """flag -> the commands that take it."""
    seen: dict[str, list[str]] = {}
    for path, cmd in every_command():
        for f in flags(cmd):
            seen.setdefault(f, []).append(path)
    return seen


def test_no_synonym_of_a_canonical_flag():
    seen = all_flags()
    bad = [f"{alias} (in {', '.join(seen[alias])}): spell it {canonical}"
           for canonical, aliases in SYNONYMS.items() for alias in aliases if alias in seen]
    assert not bad, "\n".join(bad)


def stem(flag: str) -> str:
    """--num-prompts, --prompts, --prompt -> prompt: the word a flag is about, without count prefixes or plurals."""
    word = re.sub(r"^--(num-|n-|no-)?", "", flag)
    return word[:-1] if word.endswith("s") and not word.endswith("ss") else word


# Pairs that look alike and are two concepts, each with why.
DISTINCT = {frozenset({"--rank", "--ranks"}): "--rank N picks one rank (bench step, project); --ranks says how the "
                                              "ranks run (processes | threads, one | all)"}


def test_no_two_spellings_of_one_word():
    """Flags that differ only by a plural or a num- prefix (--gpu / --gpus, --budget / --budgets) name one concept
    twice. --no-X is X's negation, and --prompt-file is another concept than --prompts N."""
    by_stem: dict[str, set[str]] = {}
    for f in all_flags():
        if not f.startswith("--no-"):
            by_stem.setdefault(stem(f), set()).add(f)
    clashes = {s: sorted(fs) for s, fs in by_stem.items() if len(fs) > 1 and frozenset(fs) not in DISTINCT}
    assert not clashes, clashes


def test_stem_finds_the_clashes_it_is_for():
    assert stem("--budgets") == stem("--budget") and stem("--num-prompts") == stem("--prompts")
    assert stem("--gpus") == stem("--gpu") and stem("--prompt-file") != stem("--prompts")


def run_defaults() -> dict:
    from ddtree.runtime.run_cli import run_command
    p = {q.name: q.default for q in run_command.params}
    return {"temperature": p["temperature"], "seed": p["seed"], "max new tokens": p["max_new_tokens"],
            "top-p": p["top_p"], "top-k": p["top_k"], "budget": int(p["budget"])}


def serve_defaults() -> dict:
    pytest.importorskip("pydantic", reason="the server's request models need the 'serve' extra")
    from ddtree.server.schemas import ChatRequest, CompletionRequest, Sampling
    from ddtree.server.serve_cli import serve_command
    field = lambda model, name: model.model_fields[name].default                       # noqa: E731
    assert field(ChatRequest, "max_tokens") is None                                   # chat: the rest of the context
    budget = {q.name: q.default for q in serve_command.params}["budget"]
    return {"temperature": field(Sampling, "temperature"),
            "seed": "random" if field(Sampling, "seed") is None else field(Sampling, "seed"),
            "max tokens": field(CompletionRequest, "max_tokens"),
            "top-p": field(Sampling, "top_p"), "top-k": field(Sampling, "top_k"), "budget": int(budget)}


def shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def test_sampling_defaults_are_what_both_help_texts_state():
    note = " ".join(SAMPLING_DEFAULTS.split())
    run_part = note.split("ddtree-run:", 1)[1].split("ddtree serve,", 1)[0]
    serve_part = note.split("ddtree serve,", 1)[1].split("Both:", 1)[0]
    both_part = note.split("Both:", 1)[1]
    run, serve = run_defaults(), serve_defaults()
    serve_label = {"max new tokens": "max tokens"}
    checked = 0
    for name, value in run.items():
        other = serve_label.get(name, name)
        if value == serve[other]:
            assert f"{name} {shown(value)}" in both_part, (name, value)
        else:
            assert f"{name} {shown(value)}" in run_part, (name, value)
            assert f"{other} {shown(serve[other])}" in serve_part, (other, serve[other])
        checked += 1
    assert checked == 6 and run["temperature"] != serve["temperature"]      # the difference the note is for


@pytest.mark.parametrize("args", [["run", "--help"], ["serve", "--help"]])
def test_both_help_texts_end_with_the_sampling_defaults(args):
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert " ".join(SAMPLING_DEFAULTS.split()) in " ".join(r.output.split())
