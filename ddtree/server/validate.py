"""Checks on a request before it reaches the engine: every refusal a 400 before any stream starts.

    data = load_json(body, max_depth=32, max_values=66432)    # bytes -> dict, bounded work
    engine.encode(check_token_ids(prompt, vocab_size, "prompt"))  # token ids: each in [0, vocab)
    check_sampling(req)                                        # SamplingParams' domain (section 5)

`load_json` is called off the event loop (a thread), and its expensive step, the C JSON parser that
holds the interpreter until it returns, only runs on a body whose shape was bounded first by a scan
that yields to other threads: the body must be UTF-8; outside its strings at most `max_values`
values (commas + 1), MAX_CONTAINERS arrays and objects (each costs the parser ~4 values' time),
nesting at most `max_depth`, and no integer of more than MAX_INT_DIGITS digits (no parameter takes
one; Python would also refuse past 4300 digits). After parsing, every string (keys included) must
be encodable as UTF-8: a `\\ud800` escape decodes to a lone surrogate the tokenizer cannot encode.
"""
from __future__ import annotations

import json
import re

from ddtree.server.errors import ApiError
from ddtree.server.limits import shown
from ddtree.tree.sampling import SamplingError, SamplingParams

MAX_CONTAINERS = 16384          # arrays + objects in one body (~12 ms for the parser at most)
MAX_INT_DIGITS = 20             # 2**64 - 1 (the largest seed) has 20
BRACKETS = re.compile(rb"[\[\]{}]")
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
LONG_INT = re.compile(rb"(?<![\d.])\d{%d}" % (MAX_INT_DIGITS + 1))


def refuse(message: str, code: str = "invalid_json", param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def outside_strings(body: bytes, max_strings: int) -> bytes:
    """The body with every JSON string's contents removed (its quotes kept): the structure alone."""
    if body.count(b'"') // 2 > max_strings:
        raise refuse(f"the request body has over {max_strings} strings (the limit on values in a body)",
                     code="request_too_complex")
    parts, in_string = [], False
    for segment in body.split(b'"'):                # a Python loop: other threads run between segments
        if not in_string:
            parts.append(segment)
            in_string = True
        elif (len(segment) - len(segment.rstrip(b"\\"))) % 2 == 0:
            in_string = False                       # this quote is not escaped: the string ends
    return b'""'.join(parts)


def check_shape(structure: bytes, max_depth: int, max_values: int) -> None:
    values = structure.count(b",") + 1
    if values > max_values:
        raise refuse(f"the request body has {values} JSON values; this server takes at most {max_values}",
                     code="request_too_complex")
    containers = structure.count(b"[") + structure.count(b"{")
    if containers > MAX_CONTAINERS:
        raise refuse(f"the request body has {containers} arrays and objects; this server takes at most "
                     f"{MAX_CONTAINERS}", code="request_too_complex")
    depth = deepest = 0
    for m in BRACKETS.finditer(structure):
        depth += 1 if m.group() in (b"[", b"{") else -1
        deepest = max(deepest, depth)
    if deepest > max_depth:
        raise refuse(f"the request body nests arrays / objects {deepest} deep; this server takes at most "
                     f"{max_depth} (--max-json-depth)", code="request_too_complex")
    long_int = LONG_INT.search(structure)
    if long_int:
        raise refuse(f"the request body has a number with more than {MAX_INT_DIGITS} digits "
                     f"({shown(long_int.group().decode())}...); no parameter takes one")


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON (NaN and Infinity are not numbers in JSON)")


def load_json(body: bytes, max_depth: int, max_values: int) -> dict:
    """The request body as a dict, or a 400 saying which limit or rule it breaks."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise refuse(f"the request body is not valid JSON: not UTF-8 at byte {e.start} "
                     f"(0x{body[e.start]:02x}: {e.reason})") from None
    check_shape(outside_strings(body, max_values), max_depth, max_values)
    try:
        data = json.loads(text, parse_constant=_no_constants)
    except (json.JSONDecodeError, ValueError, RecursionError) as e:
        raise refuse(f"the request body is not valid JSON: {shown(str(e), 200)}") from None
    if not isinstance(data, dict):
        raise refuse(f"the request body must be a JSON object, got {type(data).__name__}", code=None)
    check_strings(data, body)
    return data


def check_strings(data, body: bytes) -> None:
    """Every string, keys included, encodable as UTF-8 (a lone surrogate is not), else a 400 naming it.
    The body was strict UTF-8, so only a \\uD800-\\uDFFF escape can make one: without any, nothing to walk."""
    if not SURROGATE_ESCAPE.search(body):
        return
    stack = [data]
    while stack:                                # plain loops, no allocation per value: other threads run
        value = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str) and not _encodable(key):
                raise _surrogate(data, key)
            if isinstance(item, str):
                if not _encodable(item):
                    raise _surrogate(data, item)
            elif isinstance(item, (dict, list)):
                stack.append(item)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _path_to(node, target, path=()):
    """The keys / indices that lead from node to the object `target` (found by identity), or None."""
    if node is target:
        return path
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, item in items:
        if key is target:
            return path
        found = _path_to(item, target, path + (key,))
        if found is not None:
            return found
    return None


def _surrogate(data, text: str) -> ApiError:
    path = _path_to(data, text) or ()
    where = ".".join(str(p).encode("utf-8", "backslashreplace").decode() for p in path) or None
    at = next(i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)
    return refuse(f"{where}: a lone surrogate (U+{ord(text[at]):04X}) at character {at}; text must be valid "
                  "Unicode", code="invalid_string", param=where)


def check_token_ids(prompt, vocab_size: int, param: str):
    """A token-id prompt: every id in [0, vocab_size), else a 400 naming the first; the prompt returned."""
    for i, t in enumerate(prompt if isinstance(prompt, list) else ()):
        if not 0 <= t < vocab_size:
            raise ApiError(400, f"{param}[{i}]: token id {shown(str(t))} is outside the vocabulary "
                           f"[0, {vocab_size})", param=param, code="invalid_token_id")
    return prompt


def check_sampling(temperature: float, top_k: int, top_p: float, seed: int | None) -> None:
    """The sampling parameters in SamplingParams' domain (docs/interfaces.md section 5), a 400 if not."""
    try:
        SamplingParams(temperature=temperature, top_k=max(top_k, 0), top_p=top_p, seed=seed or 0)
    except SamplingError as e:
        name = next((n for n in ("temperature", "top_k", "top_p", "seed") if f": {n} " in str(e)), None)
        raise ApiError(400, str(e).replace("SamplingParams: ", ""), param=name) from None
