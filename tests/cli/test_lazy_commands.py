"""Commands load when they run (ddtree/lazy_group.py): `import ddtree.cli` imports no command module, a command
imports only its own, and `--help`, `--version`, the console scripts and the rooms table still see every command.

The import checks run in a fresh interpreter (this one has imported everything already) and read its sys.modules."""
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import ddtree
from ddtree import cli
from ddtree.bench import cli as bench_cli
from ddtree.lazy_group import LazyGroup
from tests.cli.command_tree import every_command
from tests.test_package_imports import may_import, room_of

ROOT = Path(__file__).resolve().parents[2]
TABLES = {"ddtree.cli": cli.COMMANDS, "ddtree.bench.cli": bench_cli.COMMANDS}
COMMAND_MODULES = sorted({t.split(":")[0] for table in TABLES.values() for t in table.values()})
# what importing the group must not drag in: the kernels, the engine, the server, numpy
HEAVY = ["ddtree.bench.kernels", "ddtree.runtime.engine", "ddtree.server", "numpy"]


def modules_after(code: str) -> set[str]:
    """sys.modules of a fresh interpreter (worktree first on the path) after running `code`."""
    script = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    return set(json.loads(r.stdout.strip().splitlines()[-1]))


def loaded(modules: set[str], name: str) -> bool:
    """`name` or a module under it was imported."""
    return any(m == name or m.startswith(name + ".") for m in modules)


def test_importing_the_cli_loads_no_command():
    mods = modules_after("import ddtree.cli")
    assert "ddtree.cli" in mods and "click" in mods                          # the import did happen
    assert not [h for h in HEAVY if loaded(mods, h)], sorted(m for m in mods if m.startswith("ddtree"))
    assert not [m for m in COMMAND_MODULES if m in mods]
    assert not loaded(mods, "ddtree.bench") and not loaded(mods, "ddtree.runtime")


def test_a_command_loads_only_its_own_modules():
    """`ddtree bench gemm --help` imports the kernel benches and not the engine, the server or the other benches."""
    mods = modules_after("from ddtree.cli import main\n"
                         "try:\n    main(['bench', 'gemm', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n")
    assert "ddtree.bench.kernels" in mods
    # other commands' modules (kernels itself imports ddtree.bench.project's roofline, a library use)
    others = ["ddtree.bench.e2e", "ddtree.bench.step", "ddtree.bench.accept", "ddtree.bench.tune",
              "ddtree.runtime.run_cli", "ddtree.builder.build_cli", "ddtree.model.synth_cli", "ddtree.server",
              "ddtree.runtime.engine"]
    assert set(others) - set(COMMAND_MODULES) == {"ddtree.server", "ddtree.runtime.engine"}    # names still true
    assert not [m for m in others if loaded(mods, m)]


def test_console_script_loads_its_command_with_version():
    """ddtree-run is `ddtree.cli:run_command` (pyproject.toml): loaded on attribute access, --version included."""
    mods = modules_after("from ddtree.cli import run_command\n"
                         "assert any('--version' in p.opts for p in run_command.params)\n")
    assert "ddtree.runtime.run_cli" in mods and not loaded(mods, "ddtree.server")
    assert "ddtree.bench.cli" not in mods and "ddtree.builder.build_cli" not in mods
    with pytest.raises(AttributeError, match="no attribute 'runcommand'"):
        cli.runcommand


def test_bench_gemm_help_runs():
    r = subprocess.run([sys.executable, "-m", "ddtree", "bench", "gemm", "--help"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Usage: python -m ddtree bench gemm [OPTIONS]" in r.stdout
    assert "--version" in r.stdout and "--json" in r.stdout


@pytest.mark.parametrize("args, group", [([], cli.main), (["bench"], bench_cli.bench)])
def test_help_lists_every_command_with_its_short_help(args, group):
    r = CliRunner().invoke(cli.main, [*args, "--help"], terminal_width=200)
    assert r.exit_code == 0, r.output
    rows = dict(re.findall(r"^  (\S+)\s+(.+)$", r.output.split("Commands:", 1)[1], re.M))
    table = TABLES[group.callback.__module__]
    assert set(rows) == set(table)
    for name, target in table.items():
        module, attr = target.split(":")
        short = getattr(importlib.import_module(module), attr).get_short_help_str(limit=1000)
        row = rows[name].strip()                                    # click cuts a long one at a word: "..."
        assert row == short or (row.endswith("...") and len(row) > 20 and short.startswith(row[:-3])), (name, row)


def test_walk_finds_every_command_defined_in_the_package():
    """Every click command of a command module is reachable from `ddtree`: a command left out of a table fails."""
    walked = {id(c) for _, c in every_command(cli.main, "ddtree")}
    package = Path(ddtree.__file__).parent
    sources = [p for p in package.rglob("*.py") if re.search(r"^@click\.(command|group)\(", p.read_text(), re.M)]
    defined = []
    for path in sources:                                              # found by reading the source, not the tables
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        mod = importlib.import_module(module)
        defined += [(f"{module}:{n}", v) for n, v in vars(mod).items()
                    if isinstance(v, click.Command) and v.callback.__module__ == module]
    assert len(defined) > len(cli.COMMANDS) + len(bench_cli.COMMANDS)          # the tables' commands and main
    assert not [name for name, cmd in defined if id(cmd) not in walked]


@pytest.mark.parametrize("group_module", sorted(TABLES))
def test_tables_name_only_rooms_the_architecture_table_allows(group_module):
    """The tables import by name, unseen by tests/test_package_imports.py's parser: hold them to the same rows."""
    allowed = may_import()[room_of(group_module)]
    rooms = {room_of(t.split(":")[0]) for t in TABLES[group_module].values()}
    assert rooms - {room_of(group_module)} <= allowed, rooms - allowed


def test_a_table_entry_that_is_no_command_is_named():
    group = LazyGroup("g", lazy_commands={"v": "ddtree.version:__version__", "w": "ddtree.version"})
    with pytest.raises(TypeError, match=r"command 'v' of 'g': ddtree.version:__version__ is str, expected a click"):
        group.get_command(None, "v")
    with pytest.raises(TypeError, match="command 'w' of 'g': ddtree.version is NoneType"):
        group.get_command(None, "w")


def test_unknown_command_suggests_a_lazy_one():
    r = CliRunner().invoke(bench_cli.bench, ["gmm"])
    assert r.exit_code == 2 and "No such command 'gmm'" in r.output
    if hasattr(click.exceptions, "NoSuchCommand"):                              # click 8.4+ suggests names
        assert "Did you mean 'gemm'?" in r.output


PLAIN = click.Command("plain", callback=lambda: None)       # a command no group has loaded: no --version yet


def test_a_lazy_command_gets_version_as_it_loads():
    assert not any("--version" in p.opts for p in PLAIN.params)
    group = LazyGroup("g", lazy_commands={"p": f"{__name__}:PLAIN"})
    r = CliRunner().invoke(group, ["p", "--version"])
    assert r.exit_code == 0 and r.output.strip() == f"ddtree, version {ddtree.__version__}", r.output
    assert group.get_command(None, "p") is PLAIN                                   # loaded once, then kept
