"""The one printer behind every command's `--json`: one JSON object on stdout, human text on stderr.

Its own module so that every CLI (ddtree/cli.py imports them all) can import it without a cycle.
Strict JSON: a NaN or infinity is an error naming where it is, never the non-standard `NaN` token
that Python's json writes by default and other parsers reject.
"""
from __future__ import annotations

import json
import math
import sys


def _non_finite(obj, path: str = "$"):
    """The JSONPath-like location of the first NaN/inf float in obj, or None."""
    if isinstance(obj, float):
        return None if math.isfinite(obj) else path
    if isinstance(obj, dict):
        items = [(f"{path}.{k}", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    else:
        return None
    for where, value in items:
        found = _non_finite(value, where)
        if found is not None:
            return found
    return None


def emit_json(obj) -> None:
    """Print obj as one line of strict JSON on stdout (same bytes as `json.dumps(obj) + "\\n"`)."""
    try:
        text = json.dumps(obj, allow_nan=False)
    except ValueError:
        where = _non_finite(obj)
        if where is None:
            raise
        raise ValueError(f"--json output: {where} is not a finite number; JSON has no NaN or infinity") from None
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
