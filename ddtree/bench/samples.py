"""What the end-to-end benches share (bench/e2e.py, one request at a time; bench/e2e_batch.py, several at once):
the summary of timed samples, and the error a float64 CPU run that breaks losslessness fails the command with."""
from __future__ import annotations

import statistics

import click


class LosslessError(click.ClickException):
    """DDTree committed other tokens than AR (or a request other tokens than itself alone) on the float64 CPU
    executor: a bug, reported as a failed bench."""


def spread(values: list[float]) -> dict:
    """{"mean", "sd" (sample stddev; 0 for one value), "min", "max"} of the samples."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "sd": sd, "min": min(values), "max": max(values)}
