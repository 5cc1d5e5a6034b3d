"""The per-rank model's op set. Today: the `ddtree` ONNX node table (nodes.py: attributes, inputs,
outputs, what kernel each launches) and its TensorRT-RTX plugins (tensorrt/). The CUDA kernels they
launch live in ddtree/plugins/, which imports nothing from here."""
