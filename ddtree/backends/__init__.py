"""The op set's backends: each runs the functions of ddtree/description on one kind of machine.

    numpy_backend.py  eager numpy ranks (math: numpy_math.py; collectives: ddtree/parallel/collectives.py)
    onnx_backend.py   the per-rank ONNX graphs (onnx_graph.py the builder, onnx_export.py the engine's graphs/,
                      onnx_nodes.py the `ddtree` nodes under onnx.reference)
    meter.py          bytes, FLOPs, kernels and collectives per op, from shapes alone
    cuda_backend.py   every op on a GPU with the kernels of ddtree/plugins (cuda_tensor.py its strided views;
                      cuda_branch, cuda_cache, cuda_moe, cuda_vocab its parts)
    tensorrt/         the `ddtree` nodes as TensorRT-RTX plugins whose enqueue launches the cuda backend's kernels
    torch_backend.py  torch tensors at tp 1, differentiable (training's target forward; the `train` extra)
The executors that drive a backend live in ddtree/runtime; the kernels in ddtree/plugins."""
