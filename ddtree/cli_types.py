"""What every command shares at its edges: finite float flags, strictly decoded prompts, a closed stdout.

- `FiniteFloatRange`: click's FloatRange that also refuses nan / inf / -inf at parse time (click's usual
  exit 2, "Invalid value for '--temperature': nan is not a finite number"); FloatRange alone takes them.
- `decode_prompt(data, source)`: prompt bytes -> text, strict UTF-8; undecodable bytes are a `PromptError`
  naming the file (or `<stdin>`, or the PROMPT argument: `check_prompt_argument`) and the byte offset.
- `QuietCommand` / `QuietGroup` (the `cls` of the entry points: `ddtree`, `ddtree-run`, `ddtree-build`):
  a reader that goes away (`ddtree run "x" | head -c 1`) ends the command quietly with exit code 141
  (128 + SIGPIPE, what a shell reports for `yes | head`), and a closed stdout or stderr (`>&-`) is
  treated as /dev/null, instead of a BrokenPipeError / AttributeError traceback. Rich's own handling of a
  closed reader (exit 1) is turned into the same exit 141. Any other OS error that reaches the top (a full
  disk, `>/dev/full`, a missing or read-only directory) is the one-line `Error: <Type>: <message>`, exit 1;
  stdout is flushed inside the command so that a failed final write is reported the same way.
- `read_prompt_bytes(stream, source)`: at most MAX_PROMPT_BYTES read, more is a `PromptError` before any
  decoding (`--prompt-file /dev/zero` or `/dev/urandom` is refused after 16 MiB, not read until memory ends).
"""
from __future__ import annotations

import errno
import math
import os
import sys

import click

from ddtree.errors import InputError

EXIT_PIPE_CLOSED = 128 + 13       # 128 + SIGPIPE: what `yes | head` exits with in a shell
MAX_PROMPT_BYTES = 16 << 20       # 16 MiB: 64x the longest context (262144 tokens) at ~1 byte per token

# The end of both `ddtree-run --help` and `ddtree serve --help`: where their defaults differ, and why. The command line
# is deterministic by default; the server takes OpenAI's defaults, which clients expect. tests/cli/test_cli_consistency.py
# checks every value here against the options' and the request models' own defaults.
SAMPLING_DEFAULTS = (
    "Sampling defaults differ between ddtree-run and ddtree serve. ddtree-run: temperature 0 (greedy), seed 0, "
    "max new tokens 128. ddtree serve, as the OpenAI API: temperature 1, seed random, max tokens 16 on "
    "/v1/completions and the rest of the context on /v1/chat/completions. Both: top-p 1, top-k 0, budget 16.")


class FiniteFloatRange(click.FloatRange):
    """A float flag that must be a finite number (and in the range, if one is given)."""

    name = "finite float range"

    def convert(self, value, param, ctx):
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value} is not a finite number", param, ctx)
        return super().convert(number, param, ctx)


def comma_list(text: str, flag: str | None, kind=int, lo=None, hi=None) -> list:
    """'1,4,16' -> [1, 4, 16] (kind int or float), in order; text that is not such a list, an empty one, or a
    value outside lo..hi is a BadParameter naming `flag`."""
    what = "integers" if kind is int else "numbers"
    try:
        values = [kind(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"'{text}' is not a comma-separated list of {what}", param_hint=flag)
    if not values:
        raise click.BadParameter(f"'{text}': expected at least one of the comma-separated {what}", param_hint=flag)
    bad = [v for v in values if (lo is not None and v < lo) or (hi is not None and v > hi)]
    if bad:
        span = f"{'' if lo is None else lo}..{'' if hi is None else hi}"
        raise click.BadParameter(f"{what} must be in {span}, got '{text}'", param_hint=flag)
    return values


class PromptError(InputError):
    """A prompt that cannot be read as text (named: the file, `<stdin>` or the PROMPT argument)."""


def _strict_utf8(data: bytes, source: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PromptError(f"{source}: not valid UTF-8 at byte {e.start} (0x{data[e.start]:02x}: {e.reason}); "
                          "expected UTF-8 text") from None


def decode_prompt(data: bytes, source: str, universal_newlines: bool = False) -> str:
    """Prompt bytes -> text, strict UTF-8 (the tokenizer is byte-level UTF-8). universal_newlines: \\r\\n and
    \\r become \\n, as text mode reads a file (a prompt file did; stdin on POSIX did not)."""
    text = _strict_utf8(data, source)
    return text.replace("\r\n", "\n").replace("\r", "\n") if universal_newlines else text


def read_prompt_bytes(stream, source: str, limit: int = MAX_PROMPT_BYTES) -> bytes:
    """At most `limit` bytes of a prompt file or stdin; a longer one is a PromptError, refused before decoding."""
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise PromptError(f"{source}: longer than {limit} bytes ({limit >> 20} MiB), the most a prompt may be; "
                          "no model's context holds that much text")
    return data


def check_prompt_argument(prompt: str) -> str:
    """The PROMPT argument as is. An argument that is not valid UTF-8 reaches Python with lone surrogates
    (surrogateescape): name its first bad byte instead of failing later inside the tokenizer."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        return _strict_utf8(os.fsencode(prompt), "the PROMPT argument")
    return prompt


def _discard_output() -> None:
    """Point stdout and stderr at /dev/null (so the interpreter's last flush cannot fail again)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in (sys.stdout, sys.stderr):
            try:
                os.dup2(devnull, stream.fileno())
            except (AttributeError, OSError, ValueError):     # no real file behind it (a test runner's)
                pass
    finally:
        os.close(devnull)


def _open_closed_streams() -> None:
    """A command started with stdout or stderr closed (`>&-`) writes to /dev/null instead of failing."""
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w")
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")


def _rich_broken_pipe(console) -> None:
    """Rich's Console.on_broken_pipe exits 1; a closed reader is EPIPE here, like any other write."""
    raise BrokenPipeError(errno.EPIPE, "the reader of the output went away")


def _stdout_discarded() -> None:
    """stdout could not be written (a full disk): what is still buffered goes to /dev/null at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):
        pass
    finally:
        os.close(devnull)


class _Quiet:
    def main(self, *args, **kwargs):
        _open_closed_streams()
        try:
            import rich.console  # optional: an ImportError here is handled
            rich.console.Console.on_broken_pipe = _rich_broken_pipe
        except ImportError:
            pass
        try:
            return super().main(*args, **kwargs)
        except OSError as e:                    # outside any command (--help into a full disk); click itself
            _stdout_discarded_if_unwritable()   # turns EPIPE here into exit 1, make_context makes it 141
            click.echo(f"Error: {type(e).__name__}: {e}", err=True)
            sys.exit(1)

    def make_context(self, *args, **kwargs):
        try:                                    # --help and --version print while the arguments are parsed
            return super().make_context(*args, **kwargs)
        except OSError as e:
            if e.errno != errno.EPIPE:
                raise
            _discard_output()
            raise click.exceptions.Exit(EXIT_PIPE_CLOSED) from None

    def invoke(self, ctx):
        try:
            result = super().invoke(ctx)
            sys.stdout.flush()                  # a failed last write is reported here, not at exit
            return result
        except OSError as e:
            if e.errno == errno.EPIPE:
                _discard_output()
                raise click.exceptions.Exit(EXIT_PIPE_CLOSED) from None
            _stdout_discarded_if_unwritable()
            raise click.ClickException(f"{type(e).__name__}: {e}") from e


def _stdout_discarded_if_unwritable() -> None:
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        _stdout_discarded()


class QuietCommand(_Quiet, click.Command):
    """A command that ends quietly when its reader goes away (see the module docstring)."""


class QuietGroup(_Quiet, click.Group):
    """A group whose commands end quietly when their reader goes away (see the module docstring)."""
