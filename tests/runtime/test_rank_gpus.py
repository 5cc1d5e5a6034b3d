"""--gpu for the ranks of a tp N engine on GPUs: one index per rank (repeats share a GPU) or one index for GPUs
g..g+N-1; anything else is refused naming the flag; a tp 2 engine's ranks on GPUs are processes."""
import pytest
from click.testing import CliRunner

from ddtree.runtime.engine import DDTreeEngine, rank_gpus
from ddtree.runtime.loop import RequestError


def test_rank_gpus():
    assert rank_gpus(0, 1) == [0] and rank_gpus(2, 3) == [2, 3, 4]
    assert rank_gpus([0, 0], 2) == [0, 0] and rank_gpus([1, 0], 2) == [1, 0]
    with pytest.raises(RequestError, match=r"--gpu 0,0,0: a tp 2 engine needs one GPU index per rank .*0,0"):
        rank_gpus([0, 0, 0], 2)


def test_the_gpu_flag_takes_a_list():
    from ddtree.runtime.run_cli import GpuIndices
    p = GpuIndices()
    assert p.convert("0", None, None) == 0 and p.convert("0,1", None, None) == [0, 1]
    for bad in ("a", "0,-1", "0,,1"):
        with pytest.raises(Exception, match="GPU ind"):
            p.convert(bad, None, None)


def test_a_tp2_engine_on_gpus_needs_rank_processes(tmp_path):
    from ddtree.builder.build import build_engine
    from ddtree.data import tiny_model_dirs
    from ddtree.runtime.cuda_executor import gpu_unavailable
    engine = build_engine(*tiny_model_dirs(), 2, ["sm_90"], tmp_path / "e", graphs=False)["engine"]
    if gpu_unavailable(0) is None:
        with pytest.raises(RequestError, match=r"ranks \(--ranks\) 'threads': a tp 2 engine on GPUs runs its ranks as "
                                               "processes"):
            DDTreeEngine.load(engine, device="cuda", gpu=[0, 0], ranks="threads")
    from ddtree.cli import main
    r = CliRunner().invoke(main, ["run", "--model", str(engine), "--device", "cuda", "--gpu", "x", "hi"])
    assert r.exit_code == 2 and "'x' is not a GPU index" in r.output
