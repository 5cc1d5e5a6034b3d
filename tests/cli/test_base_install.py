"""The README's main job needs only the base install: no torch, onnx, TensorRT or cuda-python."""
import subprocess
import sys

OPTIONAL = ["torch", "transformers", "onnx", "onnx_graphsurgeon", "tensorrt_rtx_bindings", "tensorrt_rtx_libs",
            "cuda", "cuda.core", "cuda.bindings", "jinja2", "huggingface_hub", "fastapi", "uvicorn"]
# ml_dtypes is a base dependency: the safetensors library reads bf16 into numpy through it (model/safetensors_io.py)


def test_ddtree_run_on_the_embedded_model_without_optional_packages():
    block = "; ".join(f"sys.modules[{m!r}] = None" for m in OPTIONAL)      # importing them now raises
    code = (f"import sys; {block}; from ddtree.cli import main; "
            "main(['run', 'def fib(n):', '--max-new-tokens', '16', '--json'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert '"new_tokens": 16' in r.stdout
