"""CPU tests of the skinny GEMM's measured plans (plugins/gemm_measured.py): every entry is its sweep's fastest
8-row-kernel candidate at its shape and M and beat the sweep's planned choice by >= 5 %, every row that gained that
much is in the table unless the A/B bench after it found that plan slower than the fitted one, the plans fit and
launch as the sweep ran them (cluster split-K where they qualify and the sweep took it), and SkinnyGemm takes them
only at that device, shape and M, and never under the batch-invariant plan. Three sweeps: past 16 rows (H200, with an
A/B of `bench gemm` after it), the rank step's 1 / 8 / 9 rows and its 17 (H100, tests/plugins/sweep_gemm_step.py); the
17-row step sweep supersedes the first one's rows at the same shape and M (the step's GEMMs as the step runs them,
on the kernels of today)."""
import json
from pathlib import Path

from test_batch_invariant_plans import PlanGpu

from ddtree.plugins.gemm import DSMEM_SPLITS, SkinnyGemm
from ddtree.plugins.gemm_measured import GEMM_MEASURED, STEP_AB_NOT_FASTER, measured_gemm_knobs

FIXTURES = Path(__file__).parents[1] / "fixtures" / "plugins"
SWEEP, AB = FIXTURES / "gemm_sweep_h200_tp8_dsmem_tm.json", FIXTURES / "gemm_ab_h200_tp8_measured.json"
STEP_ROWS = FIXTURES / "gemm_sweep_h100_tp8_step_rows.json"
STEP_ROWS_17 = FIXTURES / "gemm_sweep_h100_tp8_step_rows17.json"                 # budget 16's verify, 2026-12-07
H200 = ("sm_90", 132)


def h200(sm_count: int = 132):
    """The H200 as the launchers' constructors read it (test_batch_invariant_plans.PlanGpu), at another SM count."""
    gpu = PlanGpu("sm_90")
    gpu.sm_count = sm_count
    return gpu


def _sweep_rows(path=SWEEP):
    for r in json.loads(path.read_text())["rows"]:
        eight_row = [c for c in r["candidates"] if not c["kernel"].startswith("gemm_bf16_tm")]
        yield r, min(eight_row, key=lambda c: c["us"])


def _superseded() -> set:
    """(N, K, M) of the first sweep that the 17-row step sweep ran again."""
    first = {(r["N"], r["K"], r["M"]) for r, _ in _sweep_rows()}
    return first & {(r["N"], r["K"], r["M"]) for r, _ in _sweep_rows(STEP_ROWS_17)}


def _swept():
    """(N, K, M) -> the best candidate, over the three sweeps (the 17-row step sweep's where it ran a shape again;
    no other (N, K, M) is in two)."""
    rows = [*_sweep_rows(), *_sweep_rows(STEP_ROWS), *_sweep_rows(STEP_ROWS_17)]
    swept = {(r["N"], r["K"], r["M"]): best for r, best in rows}
    assert len(swept) == len(rows) - len(_superseded())
    return swept


def test_the_table_is_the_sweeps_fastest_plan_wherever_it_gained_5_percent_and_did_not_lose_the_ab():
    table = GEMM_MEASURED[H200]
    ab = {(r["N"], r["K"], r["M"]): r for r in json.loads(AB.read_text())["rows"]}
    superseded = _superseded()
    assert len(superseded) == 5 and {M for _, _, M in superseded} == {17}     # all but q_a | kv_a, new at 17
    for r, best in _sweep_rows():
        if (r["N"], r["K"], r["M"]) in superseded:
            continue
        entry = table.get((r["N"], r["K"]), {}).get(r["M"])
        a = ab[(r["N"], r["K"], r["M"])]
        lost = a["measured_plan"]["splits"] == best["splits"] and a["measured_us"] > a["fitted_us"]
        gained = r["planned"]["us"] >= 1.05 * best["us"] and not lost
        assert (entry is not None) == gained, (r["name"], r["M"], r["planned"]["us"], best["us"], a)
        if entry is not None:
            assert entry == (best["max_mt"], best["warps"], best["tpw"], best["splits"]), (r["name"], r["M"])


def test_the_step_rows_are_the_sweeps_fastest_plan_wherever_it_gained_5_percent():
    """The rank step's rows (1 / 8 / 9, and 17): exactly the rows whose best beat the planned choice by >= 5 %, as
    swept (the cluster split-K or not), but for the row counts whose step A/B was not faster (one row: NOTES)."""
    table = GEMM_MEASURED[H200]
    rows, rows17 = list(_sweep_rows(STEP_ROWS)), list(_sweep_rows(STEP_ROWS_17))
    assert {r["M"] for r, _ in rows} == {1, 8, 9} and {r["M"] for r, _ in rows17} == {17}
    assert STEP_AB_NOT_FASTER == (1,)
    rows += rows17
    assert any(r["planned"]["us"] >= 1.05 * best["us"] for r, best in rows if r["M"] == 1)   # a real exclusion
    for r, best in rows:
        entry = table.get((r["N"], r["K"]), {}).get(r["M"])
        gained = r["planned"]["us"] >= 1.05 * best["us"] and r["M"] not in STEP_AB_NOT_FASTER
        assert (entry is not None) == gained, (r["name"], r["M"], r["planned"]["us"], best["us"])
        if entry is not None:
            assert entry == (8, best["warps"], best["tpw"], best["splits"], best["dsmem"]), (r["name"], r["M"])


def test_measured_plans_are_the_swept_launches_with_the_cluster_split_where_the_sweep_took_it():
    swept = _swept()
    for (N, K), by_m in GEMM_MEASURED[H200].items():
        gemm = SkinnyGemm(h200(), N, K, 65)
        for M, (max_mt, warps, tpw, splits, *dsmem) in by_m.items():
            p, ran = gemm.plan(M), swept[(N, K, M)]
            assert (p.kernel, p.mt, p.mb, p.warps, p.tpw, p.splits, p.blocks) == \
                (ran["kernel"], ran["mt"], ran.get("mb", p.mb), ran["warps"], ran["tpw"], ran["splits"], ran["blocks"])
            assert p.smem <= 232448
            qualifies = DSMEM_SPLITS[0] <= splits <= DSMEM_SPLITS[1] and tpw <= 2
            assert p.dsmem == (qualifies and (dsmem or [True])[0])   # the sweep's launch
            assert p.dsmem == ran.get("dsmem", p.dsmem)
            assert gemm.partial.shape[0] >= p.partial_floats     # the global path's partials were allocated


def test_skinny_gemm_takes_the_table_only_at_its_device_shape_and_rows():
    N, K = 7168, 2304                                           # dense down: measured at 33 and 65 rows
    fitted = SkinnyGemm(h200(), N, K, 65, measured=False)
    gemm = SkinnyGemm(h200(), N, K, 65)
    for M in (17, 32, 34, 64):
        assert gemm.plan(M) == fitted.plan(M)
    assert gemm.plan(65) != fitted.plan(65) and gemm.plan(65).dsmem and not fitted.plan(65).dsmem
    assert gemm.measured_knobs(65) and gemm.measured_knobs(64) is None and fitted.measured_knobs(65) is None
    other = SkinnyGemm(h200(sm_count=114), N, K, 65)         # an H100 PCIe: not the swept grid
    assert other.plan(65) == SkinnyGemm(h200(sm_count=114), N, K, 65, measured=False).plan(65)
    invariant = SkinnyGemm(h200(), N, K, 65, invariant=True)
    invariant_fitted = SkinnyGemm(h200(), N, K, 65, invariant=True, measured=False)
    assert {invariant.plan(M).splits for M in (1, 33, 65)} == {invariant.fixed_splits}
    assert all(invariant.plan(M) == invariant_fitted.plan(M) for M in (17, 33, 65))
    assert invariant.plan(33) != gemm.plan(33)                   # the table's 33-row plan is not taken
    assert measured_gemm_knobs("sm_90a", 132, N, K, 65) == measured_gemm_knobs("sm_90", 132, N, K, 65)
    assert measured_gemm_knobs("sm_120", 188, N, K, 65) is None
