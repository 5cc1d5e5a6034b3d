"""`--budget auto` (docs/ddtree.md 2.7): the budget of each DDTree step chosen from cost and expected benefit.

    chooser = AutoBudget(read_tuning(engine_dir))         # the machine's step times + the calibration map
    ddtree_steps(ex, prompt, n, params, chooser, ...)     # the loop asks chooser(state) before every step

Choice from the last step's record (not inside the step): the step's graph is fixed per budget, and the
drafter's per-depth top-k table of step k is the best forecast of step k + 1's (the drafter's confidence moves
slowly along a sequence), so after step k the host computes, for every budget with a graph, the expected
committed tokens (tree/budget.py: prefix sums of calibrated path probabilities over the table's best-first
pops) and divides by the tuning file's step time at the current context bucket; the best rate picks step
k + 1's graph. The first step, with no table yet, takes the middle budget. Every step then builds its table with
k = the largest budget candidates (the tree is the same, see plugins/tree_build.py run's k), so every budget
can be evaluated. Losslessness is untouched: the budget only changes which tree is verified.
A step's choice waits for the previous record, so GPU auto steps are not enqueued ahead (pipelining off).
"""
from __future__ import annotations

import numpy as np

from ddtree.tree.budget import choose_budget, expected_accept_for_table


class AutoBudget:
    def __init__(self, tuning, budgets=None):
        self.tuning = tuning
        self.budgets = sorted(int(b) for b in (budgets or tuning.budgets))
        missing = set(self.budgets) - set(tuning.budgets)
        if missing:
            raise ValueError(f"--budget auto: budgets {sorted(missing)} have no step time in the tuning file")
        self.table_k = max(self.budgets)          # candidates per depth every step's table keeps
        self.chosen: list[int] = []

    def __call__(self, st) -> int:
        """The next step's budget for DecodeState `st` (its draft_logp: the last step's table, or None)."""
        if st.draft_logp is None:
            b = self.budgets[len(self.budgets) // 2]
        else:
            logp = np.asarray(st.draft_logp, np.float32)
            ids = np.tile(np.arange(logp.shape[1], dtype=np.int32), (logp.shape[0], 1))
            expected = expected_accept_for_table(0, logp, ids, self.table_k, self.tuning.calibration)
            b = choose_budget(expected, self.tuning.step_times_at(st.start), self.budgets)
        self.chosen.append(b)
        return b
