"""The project's error for bad input, and how a command reports it.

Every error that a user's input can cause (a checkpoint, an engine directory, a config field, a flag,
a prompt) is an `InputError` subclass whose message names the file, field or flag, the value found and
what was expected. A command turns it into one line on stderr, `Error: <Type>: <message>`, and exit
code 1 (`reported`). Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

from contextlib import contextmanager

import click


class InputError(ValueError):
    """Bad input, named: file / field / flag, the value, what was expected."""


@contextmanager
def reported():
    """Inside a click command: an InputError becomes a ClickException (exit 1, no traceback)."""
    try:
        yield
    except InputError as e:
        raise click.ClickException(f"{type(e).__name__}: {e}") from e


class ResourceError(InputError):
    """Too little of a machine's resource (disk, memory, /dev/shm) for what was asked: both amounts named."""


def available_memory() -> int | None:
    """Bytes of memory the kernel says a new allocation can get (MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
