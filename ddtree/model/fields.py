"""Typed reads of JSON config fields, each error naming the file, the dotted field, the value found and
what was expected (ConfigError by default; a reader of another file passes its own error class).

    f = Fields(d, "config.json", prefix="text_config")
    f.integer("hidden_size", lo=1);  f.number("rms_norm_eps", gt=0);  f.obj("rope_scaling", None)
"""
from __future__ import annotations

import json
import math

from ddtree.errors import InputError


class ConfigError(InputError):
    """A config.json field is missing or holds a value we do not support."""


# ----------------------------------------------------------------------------------------------
# Typed field reads

_REQUIRED = object()
_KINDS = {str: "a string", list: "a list", dict: "an object", bool: "a boolean"}


def show(value) -> str:
    """A JSON value as an error message shows it: numbers as Python prints them (nan, inf, 1e-05),
    null as null, anything else as (shortened) JSON with its kind: "64" (a string), [1] (a list)."""
    if value is None:
        return "null"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value)
    text = json.dumps(value, default=str)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({_KINDS.get(type(value), type(value).__name__)})"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int_wanted(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"an integer in {lo}..{hi}"
    if lo is not None:
        return f"an integer >= {lo}"
    return "an integer" if hi is None else f"an integer <= {hi}"


class Fields:
    """Typed reads from one JSON object of a config file. Every refusal is `error` (ConfigError unless
    given) naming the file, the dotted field, the value found and what was expected:
        f = Fields(d, "ckpt/config.json")
        t = f.obj("text_config")                 # Fields of the nested object
        t.number("rms_norm_eps", 1e-5, gt=0)        # -> ConfigError: ckpt/config.json: field
                                                    #    'text_config.rms_norm_eps' = nan: expected
                                                    #    a finite number > 0
    A field absent from the object takes `default` unchecked (no default: "missing required field");
    null is a value like any other, refused unless the read says `null_ok` (then it gives None)."""

    def __init__(self, obj, file: str, path: str = "", error: type[Exception] = ConfigError):
        self.file, self.path, self.error = str(file), path, error
        if not isinstance(obj, dict):
            where = f"field '{path}'" if path else "the file"
            raise error(f"{self.file}: {where} = {show(obj)}: expected a JSON object")
        self.d = obj

    def __contains__(self, key: str) -> bool:
        return key in self.d

    def name(self, key: str) -> str:
        """The dotted path of `key`: text_config.rope_scaling.factor."""
        return f"{self.path}.{key}" if self.path else key

    def bad(self, key: str, value, expected: str) -> Exception:
        """The error for `key` holding `value` where `expected` was wanted (raise it)."""
        return self.error(f"{self.file}: field '{self.name(key)}' = {show(value)}: expected {expected}")

    def _get(self, key: str, default, expected: str):
        if key not in self.d:
            if default is _REQUIRED:
                raise self.error(f"{self.file}: missing required field '{self.name(key)}' ({expected})")
            return default, False
        return self.d[key], True

    def raw(self, key: str, default=_REQUIRED):
        """The value as stored, unchecked (only its presence)."""
        return self._get(key, default, "required")[0]

    def integer(self, key: str, default=_REQUIRED, *, lo: int | None = None, hi: int | None = None,
            null_ok: bool = False, expected: str | None = None):
        """An integer (not a bool, float, string or null) in lo..hi."""
        want = expected or _int_wanted(lo, hi)
        v, present = self._get(key, default, want)
        if not present or (v is None and null_ok):
            return v
        if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self.bad(key, v, want)
        return v

    def number(self, key: str, default=_REQUIRED, *, gt: float | None = None, ge: float | None = None,
               null_ok: bool = False) -> float | None:
        """A finite number (an integer is fine) > gt / >= ge, as a float."""
        want = "a finite number" + (f" > {gt:g}" if gt is not None else "") + (f" >= {ge:g}" if ge is not None else "")
        v, present = self._get(key, default, want)
        if not present or (v is None and null_ok):
            return v
        if (not _is_number(v) or not math.isfinite(v) or (gt is not None and not v > gt)
                or (ge is not None and not v >= ge)):
            raise self.bad(key, v, want)
        return float(v)

    def string(self, key: str, default=_REQUIRED, choices: tuple[str, ...] | None = None,
               null_ok: bool = False) -> str | None:
        """A string, one of `choices` when given."""
        want = "a string" if choices is None else "one of " + ", ".join(json.dumps(c) for c in choices)
        v, present = self._get(key, default, want)
        if not present or (v is None and null_ok):
            return v
        if not isinstance(v, str) or (choices is not None and v not in choices):
            raise self.bad(key, v, want)
        return v

    def boolean(self, key: str, default=_REQUIRED) -> bool:
        v, present = self._get(key, default, "true or false")
        if present and not isinstance(v, bool):
            raise self.bad(key, v, "true or false")
        return v

    def obj(self, key: str, default=_REQUIRED, *, null_ok: bool = False, what: str = "") -> "Fields | None":
        """The nested object `key` as Fields (absent: default; null: None when null_ok)."""
        want = "a JSON object" + (f" ({what})" if what else "")
        v, present = self._get(key, default, want)
        if not present or (v is None and null_ok):
            return v
        if not isinstance(v, dict):
            raise self.bad(key, v, want)
        return Fields(v, self.file, self.name(key), self.error)

    def int_list(self, key: str, default=_REQUIRED, *, lo: int | None = None, hi: int | None = None,
                 nonempty: bool = True) -> list[int]:
        """A list of integers in lo..hi (non-empty unless told)."""
        want = ("a non-empty " if nonempty else "a ") + "list of " + \
            _int_wanted(lo, hi).replace("an integer", "integers", 1)
        v, present = self._get(key, default, want)
        if not present:
            return v
        if (not isinstance(v, list) or (nonempty and not v)
                or not all(_is_int(x) and (lo is None or x >= lo) and (hi is None or x <= hi) for x in v)):
            raise self.bad(key, v, want)
        return v


def check_field(ok: bool, source: tuple[str, str], name: str, value, expected: str) -> None:
    """A cross-field check of a built config: ConfigError naming file and field unless ok.
    source = (file, dotted path of the object that holds the field)."""
    if not ok:
        file, path = source
        raise ConfigError(f"{file}: field '{path + '.' if path else ''}{name}' = {show(value)}: expected {expected}")
