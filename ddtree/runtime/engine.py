"""`DDTreeEngine`: the embeddable runtime class.

    engine = DDTreeEngine.load(model_dir, drafter_dir)           # device="cpu": the numpy reference
    result = engine.generate("def fib(n):", max_new_tokens=64, budget=16)
    result.text, result.tokens, result.stats
    for token_ids in engine.stream("def fib(n):"): ...           # committed tokens, step by step

A plain prompt is encode(text) with no [BOS] (the Kimi chat template emits none, and the tiny model
was trained on windows that start anywhere in a file); an empty prompt becomes [BOS] alone. A chat
prompt (messages) is rendered with the checkpoint's chat template (docs/kimi-k2.md section 7). Generation stops on any stop token of the
tokenizer or the config's eos ids, which are kept in `tokens` but not in `text`. Prompt + new tokens
never exceed the model's context (max_position_embeddings): a longer prompt is a PromptTooLongError,
and `stats["finish_reason"]` is "stop" (a stop token) or "length" (max_new_tokens or the context).
"""
from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ddtree.data import tiny_model_dirs
from ddtree.engine_dir import is_engine_dir, read_engine_config, tokenizer_dir
from ddtree.engine_dir.tuning import read_tuning, tuning_path
from ddtree.model.tokenizer import load_tokenizer
from ddtree.parallel.rank_collective import allreduce_refusal
from ddtree.reference.drafter import Drafter
from ddtree.reference.model import Target
from ddtree.runtime.auto_budget import AutoBudget
from ddtree.runtime.engine_executor import EngineExecutor
from ddtree.runtime.executor import NumpyExecutor
from ddtree.runtime.loop import RequestError, RunStats, ar_steps, check_context, context_of, ddtree_steps
from ddtree.runtime.observed import ObservedExecutor
from ddtree.runtime.pruning import Pruner, PruneRefused, check_prune
from ddtree.runtime.ranks import RankProcesses, Request
from ddtree.runtime.request import GenerationRequest
from ddtree.tree.build import MAX_BUDGET

DEVICES = ("cpu", "cuda", "tensorrt")
MODES = ("ddtree", "ar")
RANKS = ("threads", "processes")


def rank_gpus(gpu, tp: int) -> list[int]:
    """--gpu as one GPU index per rank: a list of tp indices as given (repeats share a GPU), or one index g for
    ranks on g, g+1, .. g+tp-1."""
    gpus = list(gpu) if isinstance(gpu, (list, tuple)) else [int(gpu) + r for r in range(tp)]
    if len(gpus) != tp or min(gpus) < 0:
        raise RequestError(f"--gpu {','.join(map(str, gpus))}: a tp {tp} engine needs one GPU index per rank "
                           f"({tp} indices, e.g. {','.join('0' * tp)} for every rank on GPU 0), or one index")
    return gpus


class DeviceUnavailableError(RequestError, NotImplementedError):
    """A device this build cannot run on yet (still a NotImplementedError for callers that catch that)."""


@dataclass
class Result:
    tokens: list[int]
    text: str
    stats: dict


class DDTreeEngine:
    def __init__(self, executor, tokenizer, model_dir: Path, drafter_dir: Path | None):
        self.executor = executor
        self.tokenizer = tokenizer
        self.config = executor.config
        self.drafter_config = executor.drafter_config
        self.model_dir, self.drafter_dir = model_dir, drafter_dir
        self.stop_ids = frozenset(self.config.eos_token_ids) | frozenset(tokenizer.stop_ids)
        self.processes = None                     # runtime/ranks.RankProcesses when the ranks are processes
        self.repacked: Path | None = None         # --device cuda: the temporary engine a checkpoint became

    @classmethod
    def load(cls, model_dir=None, drafter_dir=None, device: str = "cpu", verify: bool = True,
             ranks: str = "threads", gpu: int = 0, max_context: int | None = None,
             cap_context: bool = False, kernel_plan: str = "fast", allreduce: str = "one-shot") -> "DDTreeEngine":
        """Checkpoint dirs (default: the embedded tiny model; a Hub id `owner/name` resolves through
        huggingface_hub's cache, model/hub.py), or an engine dir built by ddtree-build
        (ranks simulated on CPU), -> engine. cpu = float64 numpy. An engine dir is checked before the first
        token (engine_dir.check_engine); verify=False skips its sha256 hashes, never the structural checks.
        ranks (engine dirs): "threads" runs every rank in this process; "processes" spawns one process per
        rank 1..N-1 (runtime/ranks.py; call close(), or use the engine as a context manager).
        cuda: a tp 1 engine dir on GPU `gpu` (runtime/cuda_executor.py), or checkpoint dirs repacked at load into
        one (a temporary ddtree-build), caches of max_context rows (default: the model's context, at most 4096),
        kernels under kernel_plan ("fast" or "batch-invariant": backends/cuda_backend.py KERNEL_PLANS); a tp N engine's
        rank processes reduce through `allreduce` (parallel/rank_collective.py: one-shot, two-shot, nccl or auto)."""
        if device not in DEVICES:
            raise RequestError(f"device (--device) {device!r}: expected one of {', '.join(DEVICES)}")
        from ddtree.model.hub import resolve_model  # a local dir as is; owner/name via huggingface_hub
        model_dir, drafter_dir = resolve_model(model_dir), resolve_model(drafter_dir, "--drafter")
        if allreduce != "one-shot" and device != "cuda":
            raise RequestError(f"--allreduce {allreduce} chooses the collective of a tp N engine's rank processes on "
                               f"GPUs (--device cuda); --device {device} has none to choose")
        if device == "cuda":
            return cls._load_cuda(model_dir, drafter_dir, verify, gpu, max_context, cap_context, kernel_plan, ranks,
                                  allreduce)
        if device == "tensorrt":
            return cls._load_tensorrt(model_dir, drafter_dir, gpu, verify)
        if kernel_plan != "fast":
            raise RequestError(f"--kernel-plan {kernel_plan} is a plan of the GPU kernels (--device cuda); the cpu "
                               "executor's float64 numpy has none")
        if is_engine_dir(model_dir):          # a built engine dir (ddtree-build): it carries its drafter
            if drafter_dir is not None:
                raise RequestError(f"{model_dir} is an engine directory with its drafter built in; "
                                   f"do not pass a drafter dir (--drafter {drafter_dir})")
            if ranks not in RANKS:
                raise RequestError(f"ranks (--ranks) {ranks!r}: expected one of {', '.join(RANKS)}")
            if ranks == "processes":
                return cls._of_processes(RankProcesses(model_dir, verify=verify), model_dir)
            executor = EngineExecutor(model_dir, verify=verify)
            return cls(executor, load_tokenizer(executor.tokenizer_dir, executor.config), Path(model_dir), None)
        if model_dir is None or drafter_dir is None:
            default_model, default_drafter = tiny_model_dirs()
            model_dir = model_dir or default_model
            drafter_dir = drafter_dir or default_drafter
        target = Target.from_checkpoint(Path(model_dir))
        drafter = Drafter.from_checkpoint(Path(drafter_dir), target)
        tokenizer = load_tokenizer(model_dir, target.config)
        return cls(NumpyExecutor(target, drafter), tokenizer, Path(model_dir), Path(drafter_dir))

    @classmethod
    def _of_processes(cls, processes, model_dir) -> "DDTreeEngine":
        """The engine over started rank processes (rank 0's executor here; the processes closed on failure)."""
        try:
            ex = processes.executor
            engine = cls(ex, load_tokenizer(ex.tokenizer_dir, ex.config), Path(model_dir), None)
        except BaseException:
            processes.close()
            raise
        engine.processes = processes
        return engine

    @classmethod
    def _load_cuda(cls, model_dir, drafter_dir, verify: bool, gpu, max_context: int | None,
                   cap_context: bool = False, kernel_plan: str = "fast", ranks: str = "threads",
                   allreduce: str = "one-shot") -> "DDTreeEngine":
        # heavy: the GPU executor and its kernels' launchers (~150 ms of imports), for --device cuda only
        from ddtree.runtime.cuda_executor import CudaExecutor, gpu_unavailable
        built = None
        if model_dir is None or not is_engine_dir(model_dir):     # a checkpoint: repacked at load (interfaces 8)
            if allreduce != "one-shot":
                raise RequestError(f"--allreduce {allreduce}: checkpoint dirs are repacked into a tp 1 engine, which "
                                   "has no all-reduce to choose")
            gpu = gpu[0] if isinstance(gpu, (list, tuple)) and len(gpu) == 1 else gpu
            if isinstance(gpu, (list, tuple)):
                raise RequestError(f"--gpu {','.join(map(str, gpu))}: checkpoint dirs are repacked into a tp 1 "
                                   "engine, which runs on one GPU")
            why = gpu_unavailable(gpu)                               # said before any build
            if why:
                raise DeviceUnavailableError(f"device (--device) 'cuda' is not available: {why}")
            model_dir, drafter_dir, built = cls._repack_for_gpu(model_dir, drafter_dir, gpu)
        if drafter_dir is not None:
            raise RequestError(f"{model_dir} is an engine directory with its drafter built in; "
                               f"do not pass a drafter dir (--drafter {drafter_dir})")
        meta = read_engine_config(model_dir)
        if meta.get("kernels_skipped"):             # ddtree-build --no-kernels: said before any GPU is touched
            raise RequestError(f"--device cuda: {model_dir} was {meta['kernels_skipped']} (rebuild it with ddtree-build "
                               "--arch sm_90 or sm_120, or run it with --device cpu)")
        tp = int(meta["tp"])
        gpus = rank_gpus(gpu, tp)
        why = allreduce_refusal(allreduce, gpus) if tp > 1 else (
            f"--allreduce {allreduce}: a tp 1 engine has no all-reduce to choose" if allreduce != "one-shot" else None)
        if why:                                     # said before any GPU is touched
            raise RequestError(why)
        for g in sorted(set(gpus)):
            why = gpu_unavailable(g)
            if why:
                raise DeviceUnavailableError(f"device (--device) 'cuda' is not available: {why}")
        if tp != 1:                                 # one process per rank, each on its GPU (runtime/cuda_ranks.py)
            if ranks != "processes":
                raise RequestError(f"ranks (--ranks) {ranks!r}: a tp {tp} engine on GPUs runs its ranks as processes "
                                   "(ranks='processes')")
            cuda = {"gpus": gpus, "max_context": max_context, "cap_context": cap_context, "kernel_plan": kernel_plan,
                    "allreduce": allreduce}
            return cls._of_processes(RankProcesses(model_dir, verify=verify, cuda=cuda), model_dir)
        gpu = gpus[0]
        ex = CudaExecutor(model_dir, gpu=gpu, max_context=max_context, verify=verify, cap_context=cap_context,
                          kernel_plan=kernel_plan)
        engine = cls(ex, load_tokenizer(ex.tokenizer_dir, ex.config), Path(model_dir), None)
        engine.repacked = built
        return engine

    @classmethod
    def _load_tensorrt(cls, model_dir, drafter_dir, gpu, verify: bool = True) -> "DDTreeEngine":
        """An engine dir with TensorRT-RTX plans on GPUs of the plans' compute capability (checked first; --gpu as
        for cuda: a tp N engine runs a rank process per listed GPU)."""
        from ddtree.runtime.graph_executor import GraphExecutor  # ml_dtypes, onnx, onnx_graphsurgeon: the graphs extra
        from ddtree.runtime.trt_executor import (  # ml_dtypes, onnx, onnx_graphsurgeon: the graphs extra
            PlanDeviceError,
            PlanRanks,
            check_gpu_runs_plans,
        )
        if model_dir is None or not is_engine_dir(model_dir):
            raise RequestError("--device tensorrt runs an engine directory's TensorRT-RTX plans: build one with "
                               "ddtree-build --trt and pass it as --model")
        if drafter_dir is not None:
            raise RequestError(f"{model_dir} is an engine directory with its drafter built in; "
                               f"do not pass a drafter dir (--drafter {drafter_dir})")
        tp = int(read_engine_config(model_dir)["tp"])
        gpus = rank_gpus(gpu, tp)
        try:
            for g in sorted(set(gpus)):
                check_gpu_runs_plans(model_dir, g)          # before anything is loaded
            if tp > 1:                                      # a rank process per GPU (runtime/ranks.py)
                return cls._of_processes(RankProcesses(model_dir, verify=verify, graphs={"gpus": gpus}), model_dir)
            executor = GraphExecutor(PlanRanks(model_dir, gpus[0], verify), "tensorrt", None, tokenizer_dir(model_dir))
        except PlanDeviceError as e:
            raise DeviceUnavailableError(str(e)) from e
        return cls(executor, load_tokenizer(executor.tokenizer_dir, executor.config), Path(model_dir), None)

    @staticmethod
    def _repack_for_gpu(model_dir, drafter_dir, gpu: int):
        """A checkpoint (default: the embedded tiny model) and its drafter -> a tp 1 engine directory for this
        GPU's architecture, built in a temporary directory (removed by close() and at exit): the same
        ddtree-build an engine dir comes from, so the GPU path stays one. -> (engine dir, None, temp dir)."""
        from ddtree.builder.build import build_engine  # onnx: the graphs extra
        if model_dir is None:
            model_dir, default_drafter = tiny_model_dirs()
            drafter_dir = drafter_dir or default_drafter
        if drafter_dir is None:
            raise RequestError(f"--device cuda repacks the checkpoint {model_dir} with its drafter into a tp 1 "
                               "engine: give the drafter dir (--drafter)")
        from ddtree.plugins.device import Gpu  # heavy: with the GPU executor, for --device cuda only
        arch = Gpu(gpu).arch
        tmp = Path(tempfile.mkdtemp(prefix="ddtree-cuda-engine-"))
        atexit.register(shutil.rmtree, tmp, True)
        print(f"--device cuda: repacking {model_dir} + {drafter_dir} into a tp 1 {arch} engine in {tmp} "
              "(build it once with `ddtree build --tp 1` and pass --model ENGINE to skip this)", file=sys.stderr)
        engine = build_engine(model_dir, drafter_dir, 1, [arch], tmp / "engine", graphs=False)["engine"]
        return engine, None, tmp

    # ------------------------------------------------------------------------------------------
    def encode(self, prompt) -> list[int]:
        """str -> tokens ([BOS] if empty); list of chat messages -> the chat template; list of ints -> as is."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt) or [self.config.bos_token_id]
        prompt = list(prompt)
        if prompt and all(isinstance(m, dict) for m in prompt):
            return self.tokenizer.encode_chat(prompt)
        if all(isinstance(t, int) for t in prompt):
            bad = next((i for i, t in enumerate(prompt) if not 0 <= t < self.config.vocab_size), None)
            if bad is not None:
                raise RequestError(f"prompt[{bad}]: token id {prompt[bad]} is outside the vocabulary "
                                   f"[0, {self.config.vocab_size})")
            return prompt
        raise TypeError("prompt must be a str, a list of chat messages (dicts), or a list of token ids")

    def decode(self, tokens) -> str:
        return self.tokenizer.decode([t for t in tokens if t not in self.stop_ids])

    def _observed(self, logit_bias, param: str):
        if self.executor.name not in ("numpy", "engine-numpy"):
            raise RequestError(f"{param} is implemented on the CPU executors (--device cpu); the "
                               f"{self.executor.name} executor's fused steps sample on the device")
        try:
            return ObservedExecutor(self.executor, logit_bias)
        except ValueError as e:
            raise RequestError(str(e)) from None

    def close(self) -> None:
        """Stop the rank processes, if any, and remove an engine repacked at load (idempotent)."""
        if self.processes is not None:
            self.processes.close()
        if self.repacked is not None:
            shutil.rmtree(self.repacked, ignore_errors=True)
            self.repacked = None

    def __enter__(self) -> "DDTreeEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def pruner(self, prune: str = "off"):
        """--prune: None for "off"; for "auto" a runtime/pruning.py Pruner over this engine's executor (its tuning
        file's calibration and costs where it has one), or a PruneRefused naming what cannot prune."""
        if check_prune(prune) == "off":
            return None
        if self.processes is not None and self.processes.tp > 1:
            raise PruneRefused("--prune auto runs tp 1 engines (or tp N ranks as threads: --ranks threads); tp > 1 "
                               "rank processes take --prune off")
        tuned = self.model_dir is not None and is_engine_dir(self.model_dir) and tuning_path(self.model_dir).is_file()
        return Pruner.for_executor(self.executor, read_tuning(self.model_dir) if tuned else None)

    def auto_budget(self):
        """--budget auto: the chooser over the engine's tuning file (`ddtree tune ENGINE_DIR` writes it)."""
        if self.model_dir is None or not is_engine_dir(self.model_dir):
            raise RequestError("budget (--budget) 'auto' needs an engine directory with a tuning file "
                               "(ddtree-build, then `ddtree tune ENGINE_DIR`); this model is a checkpoint")
        if self.processes is not None and self.processes.tp > 1:
            raise RequestError("budget (--budget) 'auto' runs tp 1 engines; tp > 1 rank processes take a fixed "
                               "budget (each rank would have to agree on every choice)")
        if not tuning_path(self.model_dir).is_file():
            raise RequestError(f"budget (--budget) 'auto': {tuning_path(self.model_dir)} is missing (run "
                               f"`ddtree tune {self.model_dir}` on this machine first)")
        return AutoBudget(read_tuning(self.model_dir))

    @property
    def device(self) -> str:
        name = self.executor.name
        return name if self.processes is None or name in ("cuda", "tensorrt") else "cpu"

    def bind_thread(self) -> None:
        """Make this engine's GPU context current on the calling thread (a server's engine thread): the driver's
        context is per thread, and one made current at load on the main thread is not current on another (every
        allocation and launch there fails with CUDA_ERROR_INVALID_CONTEXT). CPU executors: nothing to do."""
        if self.executor.bind_thread is not None:
            self.executor.bind_thread()

    def device_stats(self) -> dict:
        """--device cuda: the GPU, the memory plan (bytes) and the step graphs' capture and host times."""
        return self.executor.device_stats()

    def generate(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, budget: int = 16, seed: int = 0, block_size: int | None = None,
                 mode: str = "ddtree", prune: str = "off") -> Result:
        stats = RunStats()
        tokens = [t for chunk in self.stream(prompt, max_new_tokens, temperature, top_k, top_p, budget, seed,
                                             block_size, mode, stats, prune=prune) for t in chunk]
        return Result(tokens, self.decode(tokens), stats.to_dict())

    def stream(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, budget: int = 16, seed: int = 0, block_size: int | None = None,
               mode: str = "ddtree", stats: RunStats | None = None, logit_bias: dict | None = None,
               ignore_eos: bool = False, on_logits=None, prune: str = "off") -> Iterator[list[int]]:
        """Yields the token ids each step commits (DDTree: several per step); the parameters are
        GenerationRequest's (runtime/request.py), on_logits stream_request's."""
        request = GenerationRequest(max_new_tokens, temperature, top_k, top_p, budget, seed, block_size, mode,
                                    logit_bias, ignore_eos, prune)
        return self.stream_request(prompt, request, stats, on_logits)

    def stream_request(self, prompt, request: GenerationRequest, stats: RunStats | None = None,
                       on_logits=None, union: bool = False, lane=None) -> Iterator[list[int]]:
        """stream() with its parameters as one typed object: what the server queues. on_logits(rows [len(chunk),
        V] float64) is called before each chunk is yielded with the raw target logits its tokens were sampled from
        (runtime/observed.py; logprobs). logit_bias, ignore_eos and on_logits need a CPU executor. union: a request
        on an executor with verify_requests, without logit_bias / logprobs, yields a loop.Verify before each step's
        tokens and takes the verify's result by send() (runtime/batch.py); others ignore it. lane: a GPU request
        lane (runtime/cuda_lanes.py LaneView) the request runs on; with union its DDTree steps yield loop.Fused."""
        params, budget, mode, logit_bias = request.sampling, request.budget, request.mode, request.logit_bias
        stop_ids = frozenset() if request.ignore_eos else self.stop_ids
        ids = self.encode(prompt)
        check_context(len(ids), context_of(self.config))   # a PromptTooLongError now, not at the first step
        if mode not in MODES:
            raise RequestError(f"mode (--mode) {mode!r}: expected one of {', '.join(MODES)}")
        if mode == "ddtree" and budget == "auto":
            budget = self.auto_budget()
        elif mode == "ddtree" and not (isinstance(budget, int) and 1 <= budget <= MAX_BUDGET):
            raise RequestError(f"budget (--budget) {budget!r}: expected an integer in 1..{MAX_BUDGET} or 'auto'")
        prune = self.pruner(request.prune) if mode == "ddtree" else None
        if self.processes is not None:            # every rank runs the same loop; rank 0 yields the tokens
            if logit_bias or on_logits is not None:
                raise RequestError(f"{'logit_bias' if logit_bias else 'logprobs'} needs the executor in this "
                                   "process (--device cpu with threads ranks); rank processes sample elsewhere")
            ranks_request = Request(mode, tuple(ids), request.max_new_tokens, params, budget, tuple(sorted(stop_ids)),
                                    request.block_size, prune)
            return self.processes.steps(ranks_request, stats)
        ex = self.executor if lane is None else lane
        if logit_bias or on_logits is not None:
            if lane is not None:
                raise RequestError(f"{'logit_bias' if logit_bias else 'logprobs'} needs a CPU executor; the GPU's "
                                   "batched requests (--max-num-seqs > 1) sample on the device")
            ex = self._observed(logit_bias, "logit_bias" if logit_bias else "logprobs")
        if lane is not None:                # the lane's steps are batched (loop.Fused), a pruned verify alone
            union = union and prune is None
        else:
            union = union and ex is self.executor and ex.verify_requests is not None      # not observed
        if mode == "ar":
            steps = ar_steps(ex, ids, request.max_new_tokens, params, stop_ids, stats, union)
        else:
            steps = ddtree_steps(ex, ids, request.max_new_tokens, params, budget, stop_ids, request.block_size, stats,
                                 prune, union)
        return steps if on_logits is None else _observing(steps, ex, on_logits)


def _observing(steps, ex, on_logits) -> Iterator[list[int]]:
    """steps, with on_logits(the raw target logits rows of a chunk's tokens) called before each chunk."""
    for chunk in steps:
        on_logits(ex.rows[:len(chunk)])
        yield chunk
