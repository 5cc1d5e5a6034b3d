"""The executor contract (runtime/executor.py): every executor is an Executor, one that leaves out a primitive
cannot be made, its optional abilities are declared (None when absent), and the loop and the engine ask for
abilities by attribute, never by probing (no getattr / hasattr on an executor in those modules)."""
import ast
import inspect

import pytest

import ddtree.runtime.engine as engine_module
import ddtree.runtime.loop as loop_module
from ddtree.runtime.cuda_executor import CudaExecutor
from ddtree.runtime.engine import DDTreeEngine
from ddtree.runtime.engine_executor import EngineExecutor
from ddtree.runtime.executor import Executor, NumpyExecutor
from ddtree.runtime.graph_executor import GraphExecutor
from ddtree.runtime.loop import run_to_end
from ddtree.tree.sampling import SamplingParams

EXECUTORS = [NumpyExecutor, EngineExecutor, GraphExecutor, CudaExecutor]
ABILITIES = ("ar_step", "ddtree_step", "drafter_prefill", "steps", "verify_requests")


@pytest.mark.parametrize("cls", EXECUTORS, ids=lambda c: c.__name__)
def test_every_executor_is_one_and_complete(cls):
    assert issubclass(cls, Executor) and not inspect.isabstract(cls)


def test_a_missing_primitive_is_refused_at_construction():
    class Partial(Executor):
        name, config, drafter_config = "partial", None, None

        def new_target_cache(self, capacity=256, limit=None): ...

    with pytest.raises(TypeError, match="abstract"):
        Partial()


def test_abilities_are_declared_and_the_cpu_executors_have_none():
    for name in ABILITIES:
        assert name in Executor.__dict__, name
    ex = DDTreeEngine.load().executor
    assert isinstance(ex, NumpyExecutor) and all(getattr(ex, n) is None for n in ABILITIES)
    assert callable(CudaExecutor.ar_step) and callable(CudaExecutor.ddtree_step)
    assert callable(EngineExecutor.verify_requests) and NumpyExecutor.verify_requests is None   # the union verify


def test_the_loop_and_the_engine_do_not_probe():
    for module in (loop_module, engine_module):
        tree = ast.parse(inspect.getsource(module))
        probes = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                  and n.func.id in ("getattr", "hasattr")]
        assert not probes, f"{module.__name__}: getattr/hasattr at lines {probes}"


def test_an_ability_replaces_the_composition():
    """A declared ddtree_step is what the loop calls: the reference's tokens through an executor whose step is
    the composition itself, wrapped (so the ability is used, and the tokens equal the plain run's)."""
    engine = DDTreeEngine.load()
    plain = engine.executor
    calls = []

    class Stepping(NumpyExecutor):
        def ddtree_step(self, state, params, budget):
            calls.append(budget)
            return loop_module.ddtree_step(self, state, params, budget)

    stepping = Stepping(plain.target, plain.drafter)
    prompt = engine.encode("def fib(n):")
    params = SamplingParams(temperature=0.8, seed=3)
    want = run_to_end(loop_module.ddtree_steps(plain, prompt, 24, params, 8))
    got = run_to_end(loop_module.ddtree_steps(stepping, prompt, 24, params, 8))
    assert got == want and calls and set(calls) == {8}
