"""Command line: `ddtree` (click group), `ddtree-build` and `ddtree-run` (docs/interfaces.md section 1).

Every command takes --json: one JSON object on stdout (ddtree/jsonout.py: emit_json), human text on stderr.
Every command reports bad input as one `Error: <Type>: <message>` line and exit 1 (ddtree/errors.py
reported), refuses nan/inf in float flags at parse time (exit 2), and ends quietly with exit 141 when its
reader goes away (`| head`; ddtree/cli_types.py QuietGroup / QuietCommand, the class of the three entry
points `ddtree`, `ddtree-run`, `ddtree-build`), and prints the package version with --version (every group and
subcommand: `with_version` below).
"""
from __future__ import annotations

import click

from ddtree.bench.cli import bench
from ddtree.bench.tune import tune_command
from ddtree.builder.build_cli import build_command
from ddtree.builder.inspect_cli import inspect_command
from ddtree.cli_types import QuietGroup
from ddtree.model.synth_cli import synth
from ddtree.runtime.run_cli import run_command
from ddtree.server.serve_cli import serve_command
from ddtree.version import __version__


@click.group(cls=QuietGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """ddtree: Kimi K2.x inference with DDTree tree speculative decoding."""


main.add_command(synth)
main.add_command(bench)
main.add_command(build_command, "build")
main.add_command(inspect_command, "inspect")
main.add_command(run_command, "run")
main.add_command(serve_command, "serve")
main.add_command(tune_command, "tune")


def with_version(command: click.Command) -> None:
    """Give `command` and every command under it a --version flag (`ddtree, version X`), unless it has one.
    Done here, once, so a command added to any group gets it without a decorator of its own."""
    if not any("--version" in p.opts for p in command.params):
        click.version_option(__version__, prog_name="ddtree")(command)        # appends the option to command.params
    for sub in getattr(command, "commands", {}).values():
        with_version(sub)


with_version(main)            # ddtree-run and ddtree-build are run_command and build_command: covered here too
