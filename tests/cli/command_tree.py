"""Every command under a click command, lazily loaded ones included (ddtree/lazy_group.py).

A LazyGroup's `commands` holds only what has loaded so far; `list_commands` names them all and `get_command`
loads one, as `--help` does. Shared by the tests that check something of every command."""
import click


def every_command(cmd: click.Command, path: str):
    """(path, command) for `cmd` and every group and subcommand under it, depth first, in list order."""
    yield path, cmd
    if isinstance(cmd, click.Group):
        ctx = click.Context(cmd, info_name=path)
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            assert sub is not None, f"{path} lists '{name}' and get_command does not give it"
            yield from every_command(sub, f"{path} {name}")


def leaves(cmd: click.Command, path: str):
    """(path, command) for each command under `cmd` that is no group."""
    return [(p, c) for p, c in every_command(cmd, path) if not isinstance(c, click.Group)]
