"""The session's kernels compiled in the background while the tests that need none run.

Every kernel source for sm_120 and sm_90, and the stamped diagnosis builds test_compile checks, is ~290 s of NVRTC
on one core of the 2-core CI machine (gemm.cu alone ~55 s an arch), and the suite keeps one core busy most of the
time. So one daemon thread at the lowest CPU priority (nice 19: it takes only a core nobody else wants, so timing
tests such as the server's 100 ms health check see no extra load) fills the session's cubin cache, and the modules
whose engine builds compile everything (LAST) run at the end of the session. A test that asks for a cubin the thread
is compiling waits for it (plugins/compile.py compiles a path once per process); one the thread has not reached
compiles in the test, as before. A compile error in the thread stops the thread only: the test that needs that
cubin compiles it again and reports NVRTC's log. DDTREE_TEST_PRECOMPILE=0 turns this off.
"""
import importlib.util
import os
import threading

# the modules (or folders) whose engine builds or checks compile every source for an arch, or one of the long ones,
# on CPU: whichever of them ran first in pytest's order paid the compile (the TRT build 67 s for sm_120, the two-arch
# CLI build 53 s more for sm_90; moved after the others, the next in line paid it: test_device_cuda 60 s and
# test_cli_hygiene 45 s, then the plugins' gemm.cu 44 s and router.cu 24 s, then test_graph_executor's sm_90 engine
# 22 s). With these last, the whole suite ran in 645 s instead of 728 on this 2-core machine.
LAST = ("tests/backends/test_trt_plans.py", "tests/builder/", "tests/cli/test_cli_hygiene.py",
        "tests/cli/test_device_cuda.py", "tests/plugins/", "tests/runtime/test_engine_verify.py",
        "tests/runtime/test_graph_executor.py")
STAMPED = (("router.cu", "moe.cu"), "sm_120", {"DD_STEP_STAMPS": 1})     # test_compile's diagnosis builds


def run_last(items) -> list:
    """items with LAST's modules moved to the end (stable: each part keeps pytest's order)."""
    last = [i for i in items if i.nodeid.startswith(LAST)]
    return [i for i in items if not i.nodeid.startswith(LAST)] + last


def wanted(items) -> bool:
    """Start only for a session that runs every LAST entry (the whole suite, as CI does): then the thread has the
    other tests' time to finish, and LAST asks for every cubin it compiles. A run of a few files compiles nothing
    it does not ask for, and never waits at its end for a compile it did not need."""
    if os.environ.get("DDTREE_TEST_PRECOMPILE", "1") == "0" or importlib.util.find_spec("cuda") is None:
        return False
    return all(any(i.nodeid.startswith(entry) for i in items) for entry in LAST)


def jobs() -> list:
    from ddtree.plugins.compile import kernel_jobs
    # sm_120 first: the TRT build, the first of LAST, asks for every sm_120 cubin
    everything = sorted(kernel_jobs(("sm_120", "sm_90")), key=lambda job: job[1] != "sm_120")
    sources, arch, defines = STAMPED
    return everything + [(source, arch, defines) for source in sources]


class Precompile:
    def __init__(self, cache):
        # cuda.core's first import is not thread-safe (plugins/compile.py compile_all): import here, before the thread
        import cuda.bindings.nvrtc  # noqa: F401
        import cuda.core  # noqa: F401

        from ddtree.plugins.compile import nvrtc_version
        nvrtc_version()                       # the pip NVRTC loads, or this raises and nothing starts
        self.cache, self.stop = cache, threading.Event()
        self.thread = threading.Thread(target=self._run, name="kernel-precompile", daemon=True)
        self.thread.start()

    def _run(self):
        from ddtree.plugins.compile import compile_cubin
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)    # Linux: this thread only
        except (AttributeError, OSError):
            pass
        for source, arch, defines in jobs():
            if self.stop.is_set():
                return
            try:
                compile_cubin(source, arch, defines, cache=self.cache)
            except Exception:
                return

    def close(self):
        """Stop after the compile in flight (none is left when LAST ran: it asked for every cubin)."""
        self.stop.set()
        self.thread.join()
