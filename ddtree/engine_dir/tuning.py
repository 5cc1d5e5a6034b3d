"""tuning.json: what `--budget auto` needs from the machine that runs the engine (issue 28), beside
the engine and outside its manifest.

It is machine-specific and written after the build (by `ddtree tune`), so it is not in manifest.json
(a changed manifest file is an error; engine_files leaves it out) and carries its own checksum:

    {"format": "ddtree-tuning/1",
     "machine": "NVIDIA H200",                       the GPU the step times were measured on
     "created": "2026-11-30T23:59:00Z",
     "budgets": [8, 16, 32],                         budgets with a captured graph, increasing
     "context_buckets": [1024, 8192],                context lengths measured, increasing
     "step_time_us": [[...per bucket] per budget],   one DDTree step (draft + build + verify + walk)
     "expected_distinct_experts": [per budget],      mean distinct routed experts per MoE layer a verify
                                                     of that budget touches (from the routing seen)
     "calibration": {"depths": [...], "pooled": {...}},   draft prob -> acceptance (tree/budget.py)
     "sha256": sha256 of the canonical JSON (sorted keys, no spaces) of every other field}

A file whose checksum does not match was edited (or damaged) after it was written: an error, as is any
field missing, of the wrong type or out of its range (a budget past MAX_BUDGET, a calibration sample count
that is not a count); each names the file and the field. `ddtree inspect` and `--budget auto` read the
file through the one check (read_tuning), so a file inspect passes is one auto can run.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ddtree.engine_dir.layout import TUNING, is_engine_dir, json_object, not_an_engine
from ddtree.errors import InputError
from ddtree.tree.budget import BudgetError, Calibration
from ddtree.tree.build import MAX_BUDGET

TUNING_FORMAT = "ddtree-tuning/1"
MIN_STEP_US = 1e-3                  # a step takes at least a nanosecond; below, tokens / time overflows
FIELDS = ("format", "machine", "created", "budgets", "context_buckets", "step_time_us",
          "expected_distinct_experts", "calibration", "sha256")


class TuningError(InputError):
    """tuning.json missing, edited after it was written, or with a field missing or of the wrong type."""


def tuning_path(root) -> Path:
    return Path(root) / TUNING


def canonical_sha256(fields: dict) -> str:
    """sha256 of fields as canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _increasing_ints(v) -> bool:
    return (isinstance(v, list) and len(v) > 0 and all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                                       for x in v) and all(a < b for a, b in zip(v, v[1:])))


@dataclass(frozen=True)
class Tuning:
    machine: str
    created: str
    budgets: tuple                      # [nB] budgets with a captured graph, increasing
    context_buckets: tuple              # [nC] context lengths, increasing
    step_time_us: tuple                 # [nB][nC] microseconds per DDTree step
    expected_distinct_experts: tuple    # [nB]
    calibration: Calibration

    def bucket_of(self, context: int) -> int:
        """The smallest measured bucket >= context (the largest when context is past them all)."""
        return next((c for c in self.context_buckets if c >= context), self.context_buckets[-1])

    def step_times_at(self, context: int) -> dict[int, float]:
        """{budget: step time in us} in the context bucket of `context`: the cost side of choose_budget."""
        j = self.context_buckets.index(self.bucket_of(context))
        return {b: float(row[j]) for b, row in zip(self.budgets, self.step_time_us)}

    def fields(self) -> dict:
        """The JSON object without its checksum."""
        return {"format": TUNING_FORMAT, "machine": self.machine, "created": self.created,
                "budgets": list(self.budgets), "context_buckets": list(self.context_buckets),
                "step_time_us": [[float(t) for t in row] for row in self.step_time_us],
                "expected_distinct_experts": [float(x) for x in self.expected_distinct_experts],
                "calibration": self.calibration.to_json()}


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def check_tuning_fields(d: dict, where) -> Tuning:
    """The fields of a tuning object (checksum already checked), as a Tuning; TuningError names `where`
    and the field."""
    def bad(field: str, expected: str) -> TuningError:
        return TuningError(f"{where}: field {field!r} must be {expected}, got {d.get(field)!r:.80}")

    missing = [k for k in FIELDS if k not in d]
    if missing:
        raise TuningError(f"{where}: missing field{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))}")
    unknown = [k for k in d if k not in FIELDS]
    if unknown:
        raise TuningError(f"{where}: unknown field {unknown[0]!r:.80} (a tuning file has {', '.join(FIELDS)})")
    if d["format"] != TUNING_FORMAT:
        raise bad("format", repr(TUNING_FORMAT))
    for k in ("machine", "created"):
        if not isinstance(d[k], str) or not d[k]:
            raise bad(k, "a non-empty string")
    for k in ("budgets", "context_buckets"):
        if not _increasing_ints(d[k]):
            raise bad(k, "a non-empty increasing list of positive ints")
    if d["budgets"][-1] > MAX_BUDGET:
        raise bad("budgets", f"budgets in 1..{MAX_BUDGET} (the most a DDTree step drafts)")
    nB, nC = len(d["budgets"]), len(d["context_buckets"])
    times = d["step_time_us"]
    if not (isinstance(times, list) and len(times) == nB and all(
            isinstance(row, list) and len(row) == nC and all(_number(t) and t >= MIN_STEP_US for t in row)
            for row in times)):
        raise bad("step_time_us", f"[{nB} budgets][{nC} context buckets] of microseconds >= {MIN_STEP_US}")
    experts = d["expected_distinct_experts"]
    if not (isinstance(experts, list) and len(experts) == nB and all(_number(x) and x >= 0 for x in experts)):
        raise bad("expected_distinct_experts", f"a list of {nB} numbers >= 0 (one per budget)")
    try:
        calibration = Calibration.from_json(d["calibration"], f"{where}: field calibration")
    except BudgetError as e:
        raise TuningError(str(e)) from e
    return Tuning(d["machine"], d["created"], tuple(d["budgets"]), tuple(d["context_buckets"]),
                  tuple(tuple(row) for row in times), tuple(experts), calibration)


def write_tuning(root, tuning: Tuning) -> Path:
    """root/tuning.json with its checksum, checked first (an invalid Tuning writes nothing); atomic."""
    root = Path(root)
    if not is_engine_dir(root):
        raise not_an_engine(root)
    path = tuning_path(root)
    fields = tuning.fields()
    check_tuning_fields({**fields, "sha256": ""}, path)
    tmp = root / f".{TUNING}.tmp"
    tmp.write_text(json.dumps({**fields, "sha256": canonical_sha256(fields)}, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def read_tuning(root, where=None) -> Tuning:
    """root/tuning.json, its checksum and every field checked. TuningError names the file (as `where`,
    default its path) and the field."""
    path = tuning_path(root)
    where = path if where is None else where
    if not path.is_file():
        raise TuningError(f"{where}: missing (`ddtree tune ENGINE_DIR` measures this machine and writes it)")
    d = json_object(path, lambda why: TuningError(f"{where}: {why} (re-run `ddtree tune`)"))
    if not isinstance(d.get("sha256"), str):
        raise TuningError(f"{where}: field 'sha256' must be the file's checksum (64 hex digits), "
                          f"got {d.get('sha256')!r:.80}")
    want = canonical_sha256({k: v for k, v in d.items() if k != "sha256"})
    if d["sha256"] != want:
        raise TuningError(f"{where}: its fields do not match its checksum sha256 ({d['sha256'][:16]}..., the "
                          f"fields hash to {want[:16]}...): the file was edited or damaged after `ddtree tune` "
                          "wrote it; re-run `ddtree tune`")
    return check_tuning_fields(d, where)


def tuning_problems(root) -> tuple[Tuning | None, list[str]]:
    """`ddtree inspect`: (the tuning, []) or (None, [] when there is no tuning file, else its one problem
    as "tuning.json: ...")."""
    if not tuning_path(root).is_file():
        return None, []
    try:
        return read_tuning(root, where=TUNING), []
    except TuningError as e:
        return None, [str(e)]


def describe_tuning(tuning: Tuning) -> list[str]:
    """Lines for `ddtree inspect`: machine, date, step time per budget and bucket, experts, calibration."""
    buckets = "  ".join(f"{c:>9}" for c in tuning.context_buckets)
    lines = [f"  tuning   {tuning.machine}, {tuning.created}",
             f"    budget  experts  step us at context {buckets}"]
    for b, row, e in zip(tuning.budgets, tuning.step_time_us, tuning.expected_distinct_experts):
        lines.append(f"    {b:>6}  {e:>7.1f}  {'':>18} " + "  ".join(f"{t:>9.1f}" for t in row))
    cal = tuning.calibration
    fitted = [str(i + 1) for i, m in enumerate(cal.depths) if m]
    lines.append(f"    calibration: {cal.pooled['samples']} edges, per-depth maps for depths "
                 f"{', '.join(fitted) or 'none'}")
    return lines
