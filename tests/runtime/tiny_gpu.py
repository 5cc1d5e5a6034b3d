"""The embedded tiny model's tp 1 engine on the GPU with the held-out prompts: what the step-graph GPU tests
run (fast and batch-invariant kernel plans alike)."""


def tiny_gpu_executor(tmp_path_factory, name: str, n_prompts: int = 4, **executor_kw):
    """(CudaExecutor over a freshly built tiny engine with 512 cache rows, token ids of n_prompts prompts)."""
    from ddtree.builder.build import build_engine
    from ddtree.data import tiny_model_dirs
    from ddtree.model.tokenizer import load_tokenizer
    from ddtree.runtime.cuda_executor import CudaExecutor
    from tests.runtime.test_ddtree_trained import prompts
    root = tmp_path_factory.mktemp(name)
    engine = build_engine(*tiny_model_dirs(), 1, ["sm_90"], root / "engine", graphs=False)["engine"]
    ex = CudaExecutor(engine, max_context=512, **executor_kw)
    tok = load_tokenizer(ex.tokenizer_dir, ex.config)
    return ex, [tok.encode(p) for p in prompts(n_prompts)]
