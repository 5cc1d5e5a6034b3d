"""Command line: `ddtree` (click group), `ddtree-build` and `ddtree-run` (docs/interfaces.md section 1).

Every command takes --json: one JSON object on stdout (ddtree/jsonout.py: emit_json), human text on stderr.
Every command reports bad input as one `Error: <Type>: <message>` line and exit 1 (ddtree/errors.py
reported), refuses nan/inf in float flags at parse time (exit 2), and ends quietly with exit 141 when its
reader goes away (`| head`; ddtree/cli_types.py QuietGroup / QuietCommand, the class of the three entry
points `ddtree`, `ddtree-run`, `ddtree-build`), and prints the package version with --version (every group and
subcommand: ddtree/lazy_group.py with_version).

The commands are imported when they run (ddtree/lazy_group.py): `import ddtree.cli` loads no numpy, kernels
or server, and `ddtree run` loads only the run command.
"""
from __future__ import annotations

import click

from ddtree.lazy_group import QuietLazyGroup, with_version

# name -> "module:attribute" of each `ddtree` command, imported on first use (`ddtree --help` loads them all)
COMMANDS = {
    "bench": "ddtree.bench.cli:bench",
    "build": "ddtree.builder.build_cli:build_command",
    "inspect": "ddtree.builder.inspect_cli:inspect_command",
    "run": "ddtree.runtime.run_cli:run_command",
    "serve": "ddtree.server.serve_cli:serve_command",
    "synth": "ddtree.model.synth_cli:synth",
    "tune": "ddtree.bench.tune:tune_command",
}

# pyproject.toml's console scripts other than `ddtree`: ddtree-run = "ddtree.cli:run_command", and build
SCRIPTS = {"run_command": "run", "build_command": "build"}


@click.group(cls=QuietLazyGroup, lazy_commands=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """ddtree: Kimi K2.x inference with DDTree tree speculative decoding."""


with_version(main)


def __getattr__(name: str) -> click.Command:
    # `from ddtree.cli import run_command` (the ddtree-run script): the command as `ddtree run` loads it, --version
    # included, imported only now
    if name in SCRIPTS:
        return main.get_command(None, SCRIPTS[name])
    raise AttributeError(f"module 'ddtree.cli' has no attribute '{name}'")
