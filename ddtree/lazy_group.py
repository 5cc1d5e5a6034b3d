"""A click group whose commands are imported when they run (click's "lazily loading subcommands" pattern).

`ddtree` and `ddtree bench` name their commands in a table, name -> "module:attribute"; `list_commands` reads
the table and `get_command` imports the one module asked for. `import ddtree.cli` then costs click and this
file, not numpy, the kernels and the server: `ddtree run` loads only the run command, `ddtree bench gemm` only
the kernel benches. `--help` lists every command with its short help, so it loads them all.

Every command a LazyGroup loads gets a `--version` flag (`ddtree, version X`; `with_version`), so a command
added to a table has one without a decorator of its own.
"""
from __future__ import annotations

import importlib

import click

from ddtree.cli_types import QuietGroup
from ddtree.version import __version__

# click 8.4+ suggests close names ("Did you mean 'bench'?") from group.commands; older click has no such error
_NoSuchCommand = getattr(click.exceptions, "NoSuchCommand", ())


def with_version(command: click.Command) -> click.Command:
    """Give `command` and every command already under it a --version flag, unless it has one. The commands
    of a LazyGroup get theirs as they load."""
    if not any("--version" in p.opts for p in command.params):
        click.version_option(__version__, prog_name="ddtree")(command)        # appends the option to command.params
    for sub in getattr(command, "commands", {}).values():
        with_version(sub)
    return command


class LazyGroup(click.Group):
    """A group whose commands are `lazy_commands`: name -> "module:attribute", imported on first use."""

    def __init__(self, *args, lazy_commands: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy_commands = dict(lazy_commands or {})

    def list_commands(self, ctx) -> list[str]:
        return sorted(set(self.commands) | set(self.lazy_commands))

    def get_command(self, ctx, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy_commands:
            self.add_command(with_version(self._load(cmd_name)), cmd_name)     # loaded once, then a plain command
        return super().get_command(ctx, cmd_name)

    def _load(self, cmd_name: str) -> click.Command:
        target = self.lazy_commands[cmd_name]
        module_name, _, attribute = target.partition(":")
        command = getattr(importlib.import_module(module_name), attribute, None)
        if not isinstance(command, click.Command):
            raise TypeError(f"command '{cmd_name}' of '{self.name}': {target} is "
                            f"{type(command).__name__}, expected a click command ('module:attribute')")
        return command

    def resolve_command(self, ctx, args):
        try:
            return super().resolve_command(ctx, args)
        except _NoSuchCommand as e:              # suggest from every name, not only the commands loaded so far
            raise _NoSuchCommand(e.command_name, possibilities=self.list_commands(ctx), ctx=ctx) from None


class QuietLazyGroup(LazyGroup, QuietGroup):
    """A LazyGroup that ends quietly when its reader goes away (exit 141; ddtree/cli_types.py QuietGroup)."""
