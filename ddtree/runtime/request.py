"""One generation's parameters, as the engine takes them from any caller (the CLI, the server, an embedder).

    request = GenerationRequest(max_new_tokens=64, temperature=0.7, seed=1)
    for tokens in engine.stream_request(prompt_ids, request): ...

The defaults are the engine's (DDTreeEngine.generate / stream keep the same ones as keywords); the server fills
every field from the OpenAI request before it queues the job.
"""
from __future__ import annotations

from dataclasses import dataclass

from ddtree.tree.sampling import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    max_new_tokens: int = 128
    temperature: float = 0.0              # 0: greedy
    top_k: int = 0                        # 0: no top-k cut
    top_p: float = 1.0                    # 1: no nucleus cut
    budget: int | str = 16                # DDTree's tree budget, or "auto" (the engine's tuning file)
    seed: int = 0
    block_size: int | None = None         # the drafter's block (None: its config's)
    mode: str = "ddtree"                  # "ddtree" | "ar"
    logit_bias: dict | None = None        # {token id: bias} added to the target logits before sampling (the same
                                          # at every position, so DDTree still commits what AR commits)
    ignore_eos: bool = False              # no stop token ends the run (max_new_tokens or the context do)
    prune: str = "off"                    # "off" | "auto": prune the tree inside each verify (runtime/pruning.py)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed)
