"""ddtree: ahead-of-time compiled Kimi K2.x inference with DDTree tree speculative decoding."""
import os

# The numpy reference runs many small float64 GEMMs ([<=256, H] x [H, I]); OpenBLAS's thread pool
# makes those ~10x slower than one thread on a 2-core machine. Set before numpy loads; an explicit
# OPENBLAS_NUM_THREADS in the environment wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from ddtree.version import __version__  # noqa: E402,F401  (after the thread setting above)


def __getattr__(name):
    # `ddtree.DDTreeEngine` without importing numpy and the reference at `import ddtree`
    if name == "DDTreeEngine":
        from ddtree.runtime.engine import DDTreeEngine  # heavy: `import ddtree` stays free of numpy
        return DDTreeEngine
    raise AttributeError(f"module 'ddtree' has no attribute '{name}'")
