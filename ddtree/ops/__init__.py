"""The per-rank model written once, and the backends that run it.

    opset.py          the op set: every op a rank performs, with shapes and dtypes (Ops)
    layers.py         the layer kinds as functions over the op set (embed, decoder layer, head, drafter, tree)
    numpy_backend.py  eager numpy ranks (math: numpy_math.py; collectives: collectives.py)
    onnx_backend.py   the per-rank ONNX graphs (onnx_graph.py builder, onnx_export.py the engine's graphs/,
                      onnx_nodes.py the `ddtree` nodes under onnx.reference, onnx_runner.py ranks as threads)
    meter.py          bytes, FLOPs, kernels and collectives per op, from shapes alone
    cuda_backend.py   every op on one GPU with the kernels of ddtree/plugins (tp 1; runtime/cuda_executor.py),
                      its tensors strided views (cuda_tensor.py)
    nodes.py          the `ddtree` custom-node table; tensorrt/ its TensorRT-RTX plugins
    vocab_parallel.py sampling and draft top-k on vocab-split logits (the executors' merges)
The CUDA kernels live in ddtree/plugins/, which imports nothing from here; the float64 oracle in
ddtree/reference/ is the model's only other copy and is not imported here."""
