"""The op-set backends: each implements ops/opset.py's `Ops` so the layer functions of ops/layers.py run on it."""
