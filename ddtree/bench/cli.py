"""`ddtree bench <what>`: kernel and end-to-end benchmarks, JSON output (docs/interfaces.md sections 1, 7)."""
import click


@click.group("bench")
def bench():
    """Benchmarks against the bandwidth roofline (`--json` for machine output)."""


from ddtree.bench.kernels import gemm_command, moe_command  # noqa: E402

bench.add_command(moe_command)
bench.add_command(gemm_command)

from ddtree.bench.attention import attention_command  # noqa: E402

bench.add_command(attention_command)

from ddtree.bench.tree import tree_command  # noqa: E402

bench.add_command(tree_command)


from ddtree.bench.accept import accept  # noqa: E402  (imports after the group, no cycle)

bench.add_command(accept)

from ddtree.bench.project import project_command  # noqa: E402

bench.add_command(project_command)

from ddtree.bench.e2e import e2e_command  # noqa: E402

bench.add_command(e2e_command)

from ddtree.bench.step import step_command  # noqa: E402

bench.add_command(step_command)

from ddtree.bench.allreduce import allreduce_command  # noqa: E402

bench.add_command(allreduce_command)

from ddtree.bench.chain import chain_command  # noqa: E402

bench.add_command(chain_command)
