"""`ddtree bench <what>`: kernel and end-to-end benchmarks, JSON output (docs/interfaces.md sections 1, 7).

Each bench is imported when it runs (ddtree/lazy_group.py): `ddtree bench gemm` loads the kernel benches, not
the end-to-end engine or the step bench's numpy model."""
import click

from ddtree.lazy_group import LazyGroup

# name -> "module:attribute", imported on first use (`ddtree bench --help` loads them all)
COMMANDS = {
    "accept": "ddtree.bench.accept:accept",
    "allreduce": "ddtree.bench.allreduce:allreduce_command",
    "attention": "ddtree.bench.attention:attention_command",
    "chain": "ddtree.bench.chain:chain_command",
    "e2e": "ddtree.bench.e2e:e2e_command",
    "gemm": "ddtree.bench.kernels:gemm_command",
    "moe": "ddtree.bench.kernels:moe_command",
    "project": "ddtree.bench.project:project_command",
    "step": "ddtree.bench.step:step_command",
    "tree": "ddtree.bench.tree:tree_command",
}


@click.group("bench", cls=LazyGroup, lazy_commands=COMMANDS)
def bench():
    """Benchmarks against the bandwidth roofline (`--json` for machine output)."""
