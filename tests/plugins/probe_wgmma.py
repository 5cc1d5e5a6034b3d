"""Device probe of the tree_wgmma form's operand layouts (one case, V's descriptor offsets as compiled and
swapped: -D WG_V_SWAP): lse depends on Q.K^T alone, out also on P.V, so the two errors say which product is
wrong. python3 tests/plugins/probe_wgmma.py (repo root, an sm_90 GPU)."""
import sys

import numpy as np

sys.path.insert(0, "tests/plugins")
import attention_cases as ac  # noqa: E402
from test_mla_attention_gpu import Setup  # noqa: E402

from ddtree.plugins import mla_attention as ma  # noqa: E402
from ddtree.plugins.device import Gpu  # noqa: E402

gpu = Gpu()
for T, q in ((100, 65), (4096, 17)):
    s = Setup(gpu, T, q, 8)
    ref_out, ref_lse = ac.reference(T, q, 8, s.case)
    for swap in (0, 1):
        ma.WGMMA_DEFINES = {"MLA_TREE_WGMMA": 1, "WG_V_SWAP": swap}
        for stages, splits in ((2, 1), (2, 3)):
            out, lse, plan = s.run(form="tree_wgmma", stages=stages, splits=splits)
            e_out = np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out)
            e_lse = np.nanmax(np.abs(lse - ref_lse))
            print(f"T={T} q={q} swap={swap} stages={stages} splits={splits}: out rel err {e_out:.3e}, "
                  f"lse max err {e_lse:.3e}, finite {np.isfinite(out).mean():.3f}", flush=True)
