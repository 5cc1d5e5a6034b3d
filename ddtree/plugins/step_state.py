"""Launchers for the decode step's device state (kernels/step_state.cu) and their numpy twins.

    st = StepState(gpu, max_tokens=16)              # state [start, bonus, steps] + a host-mapped record ring
    st.set(start=P, bonus=t)                        # outside any graph: a new request's first state
    st.prologue(b, mask, window, block_ids, block_pos, draft_len, target_len)
    st.ctx_window(window_in, taps, accepted, count, window_out, b, row_bytes)
    st.commit(tree_tokens, accepted, count, token, status=(sampler.status, builder.status))
    rec = st.record(step)                           # after the step's replay finished: dict or None

Every launch reads the per-step values on the device, so a captured graph replays every step and every
request (docs/interfaces.md section 8). The record ring is host-mapped pinned memory: the commit kernel writes
a slot and then its step number, after a system fence; the host trusts a slot only when it holds the step
number it expects.
"""
from __future__ import annotations

import numpy as np

from ddtree.plugins.device import Gpu, ptr
from ddtree.plugins.gemm import supports_pdl

SOURCE = "step_state.cu"
START, BONUS, STEPS = 0, 1, 2
STATE_WORDS = 4
SEQ, COUNT, STATUS, REC_START, TOKENS = 0, 1, 2, 3, 4
SLOTS = 4


# ---- numpy twins ---------------------------------------------------------------------------------
def prologue_ref(state, b: int, mask_token: int, window: int) -> dict:
    start, bonus = int(state[START]), int(state[BONUS])
    return {"block_ids": np.array([bonus] + [mask_token] * (b - 1), np.int32),
            "block_pos": np.arange(start, start + b, dtype=np.int32),
            "draft_len": start - window, "target_len": start}


def ctx_window_ref(window: np.ndarray, taps: np.ndarray, accepted, count: int) -> np.ndarray:
    """window [b, W], taps [n, W]: the taps of the last b committed positions after `count` new ones."""
    b, c = window.shape[0], min(int(count), window.shape[0])
    return np.concatenate([window[c:], taps[np.asarray(accepted[:c])]])


def force_accept_ref(parents, a: int) -> list[int]:
    """The root's first-child chain, at most `a` nodes (parents[i] < i; a child's first is its lowest index)."""
    path = [0]
    for j in range(1, len(parents)):
        if len(path) < a and parents[j] == path[-1]:
            path.append(j)
    return path


def commit_ref(state, tree_tokens, accepted, count: int | None, token: int) -> tuple[list[int], np.ndarray]:
    """-> (the committed tokens, the state after). count None: the autoregressive step (one token)."""
    tokens = [int(token)] if count is None else [int(tree_tokens[a]) for a in accepted[1:count]] + [int(token)]
    after = np.array(state, np.int32).copy()
    after[START] += len(tokens)
    after[BONUS] = token
    after[STEPS] += 1
    return tokens, after


# ---- launchers -----------------------------------------------------------------------------------
class StepState:
    def __init__(self, gpu: Gpu, max_tokens: int, slots: int = SLOTS, pdl: bool | None = None):
        self.gpu, self.slots = gpu, slots
        self.record_words = TOKENS + max_tokens
        self.pdl = supports_pdl(gpu) if pdl is None else pdl
        self.state = gpu.zeros((STATE_WORDS,), np.int32)
        self.ring, self.ring_device = gpu.mapped((slots, self.record_words), np.int32)
        self.steps = 0                                   # host mirror of state[STEPS]

    def _launch(self, name: str, grid, block: int, *args, stream=None) -> None:
        self.gpu.launch(self.gpu.kernel(SOURCE, name), grid, block, 0, *args, stream=stream, pdl=self.pdl)

    def set(self, start: int, bonus: int) -> None:
        """A new state (outside graphs; synchronises): the committed length and the token at it."""
        self.gpu.copy_in(self.state, np.array([start, bonus, self.steps, 0], np.int32))

    def read(self) -> tuple[int, int]:
        """(start, bonus) on the device (synchronises; outside graphs)."""
        s = self.state.numpy()
        return int(s[START]), int(s[BONUS])

    @property
    def start_ptr(self) -> int:
        return self.state.ptr + 4 * START

    @property
    def bonus_ptr(self) -> int:
        return self.state.ptr + 4 * BONUS

    def prologue(self, b: int, mask_token: int, window: int, block_ids, block_pos, draft_len=None, target_len=None,
                 stream=None) -> None:
        if not 1 <= b <= 1024:
            raise ValueError(f"step_prologue: b = {b} must be in 1..1024")
        self._launch("step_prologue", 1, 32 * -(-b // 32), ptr(self.state), np.int32(b), np.int32(mask_token),
                     np.int32(window), ptr(block_ids), ptr(block_pos), ptr(draft_len), ptr(target_len), stream=stream)

    def ctx_window(self, window_in, taps, accepted, count, window_out, b: int, row_bytes: int, stream=None) -> None:
        if row_bytes % 16:
            raise ValueError(f"ctx_window: rows of {row_bytes} B must be a multiple of 16 B")
        vecs = row_bytes // 16
        self._launch("ctx_window", b, min(256, 32 * -(-vecs // 32)), ptr(window_in), ptr(taps), ptr(accepted),
                     ptr(count), ptr(window_out), np.int32(vecs), stream=stream)

    def force_accept(self, parents, n: int, a: int, accepted, count, stream=None) -> None:
        """Benchmarks only: accepted[:count] = force_accept_ref(parents[:n], a) (the walk's result replaced)."""
        if a < 1:
            raise ValueError(f"step_force_accept: a = {a} accepted nodes; at least the root (1)")
        self._launch("step_force_accept", 1, 32, ptr(parents), np.int32(n), np.int32(a), ptr(accepted), ptr(count),
                     stream=stream)

    def commit(self, tree_tokens, accepted, count, token, status=(None, None), stream=None) -> None:
        self._launch("step_commit", 1, 128, ptr(self.state), ptr(tree_tokens), ptr(accepted), ptr(count), ptr(token),
                     ptr(status[0]), ptr(status[1]), np.uint64(self.ring_device), np.int32(self.slots),
                     np.int32(self.record_words), stream=stream)

    def record(self, step: int) -> dict | None:
        """The record of step number `step` (1-based, counted over the state's life) once written, else None."""
        slot = self.ring[(step - 1) % self.slots]
        if int(slot[SEQ]) != step:
            return None
        count = int(slot[COUNT])
        return {"count": count, "status": int(slot[STATUS]), "start": int(slot[REC_START]),
                "tokens": [int(t) for t in slot[TOKENS: TOKENS + count]]}
