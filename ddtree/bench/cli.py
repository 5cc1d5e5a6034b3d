"""`ddtree bench <what>`: kernel and end-to-end benchmarks, JSON output (interfaces.md sections 1, 7)."""
import click


@click.group("bench")
def bench():
    """Benchmarks against the bandwidth roofline (`--json` for machine output)."""
