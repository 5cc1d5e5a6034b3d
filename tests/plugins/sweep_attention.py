"""Attention plan sweeps in one process (one GPU open, one copy ceiling): every combination of each spec's
values timed as `ddtree bench attention` times it (ddtree.bench.attention.bench_case), one JSON line per row
on stdout (tagged with its spec), progress on stderr. On the GPU machine:

    python3 tests/plugins/sweep_attention.py "T=4096,32768 q=8,17 form=tree warps=2,4,8 stages=2,3 parts" \\
                                             "T=4096 q=17 form=tree warps=4 stages=2 splits=6,12,25 l2" ...

Keys: T, q, heads (default 8), form, warps, stages, splits, row_groups, scale (comma lists; scale multiplies
the prefix splits the plan would choose for the other forced knobs, e.g. scale=0.5,1,2); flags: parts (the
split kernel alone and the combine alone too), l2 (one cache re-read from L2: the compute-side rate), nopdl
(plain stream order instead of programmatic dependent launches). Forced
combinations that are not compiled or do not fit are named on stderr and skipped.
"""
import itertools
import json
import sys

from ddtree.bench.attention import bench_case
from ddtree.bench.kernels import open_gpu
from ddtree.plugins.mla_attention import plan_attention

KNOBS = ("form", "warps", "stages", "splits", "row_groups")


def parse(spec: str) -> tuple[dict[str, list], set[str]]:
    values, flags = {}, set()
    for word in spec.split():
        if "=" in word:
            key, text = word.split("=", 1)
            values[key] = [v if key == "form" else float(v) if key == "scale" else int(v) for v in text.split(",")]
        else:
            flags.add(word)
    unknown = (set(values) - {"T", "q", "heads", "scale", *KNOBS}) | (flags - {"parts", "l2", "nopdl"})
    if unknown:
        raise SystemExit(f"sweep_attention: unknown keys {sorted(unknown)} in {spec!r}")
    return values, flags


def main(specs: list[str]) -> None:
    gpu, ceiling = open_gpu()
    for spec in specs:
        values, flags = parse(spec)
        knobs = [k for k in KNOBS if k in values]
        for T, q, heads, scale, *combo in itertools.product(values["T"], values["q"], values.get("heads", [8]),
                                                            values.get("scale", [None]), *(values[k] for k in knobs)):
            forced = dict(zip(knobs, combo))
            try:
                if scale is not None:
                    P = plan_attention(q, heads, T, gpu.sm_count, gpu.smem_optin, latent=512, rope=64,
                                       **forced).prefix_splits
                    forced["splits"] = max(1, round(P * scale))
                row = bench_case(gpu, T, q, heads, 8, ceiling["gbps"], forced, "l2" in flags, "parts" in flags,
                                 "nopdl" not in flags)
            except ValueError as e:
                gpu.free_all()
                print(f"T={T} q={q} H={heads} {forced}: skipped: {e}", file=sys.stderr)
                continue
            print(json.dumps({"spec": spec, "forced": forced, "device": gpu.name, "ceiling_gbps": ceiling["gbps"],
                              **row}), flush=True)
            p = row["plan"]
            print(f"T={T:6d} q={q:3d} {row['latency_us']:8.2f} us {row['pct_of_ceiling']:5.1f} % "
                  f"{row['tflops']:6.1f} TF  {p['form']} w{p['warps']} s{p['stages']} g{p['row_groups']} "
                  f"x{p['row_tiles']} P{p['prefix_splits']}{'+t' if p['tree_own'] else ''}"
                  f"{'' if row['pdl'] else ' no-pdl'}"
                  + (f"  split {row['split_us']} combine {row['combine_us']}" if "parts" in flags else "")
                  + ("  (L2)" if "l2" in flags else ""), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
