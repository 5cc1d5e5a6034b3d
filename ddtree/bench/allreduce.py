"""`ddtree bench allreduce`: the one-shot peer-to-peer all-reduce (plugins/allreduce.py: push, pull, or the two-shot
protocol of the same buffer) against NCCL
(parallel/nccl_group.py) on M x hidden bf16 messages, one process per GPU (docs/interfaces.md section 9).

Two timings per (impl, M):
    alone     a CUDA graph of one all-reduce, replayed back to back `--replays` times with an event between
              replays (no host sync between them, so the ranks run in step): the median replay
    in_graph  a graph of `--collectives` (122: Kimi's all-reduces per step) all-reduces, each after a small
              kernel writing the next input (fill_hash_u32); minus the same graph without the all-reduces,
              per all-reduce
`--probe` reports instead what the GPUs allow: peer access both ways, the P2P attributes, and the round
trip of a system-scope flag between two GPUs through IPC-mapped memory (allreduce_pingpong).
Rows: {"impl", "ranks", "bytes", "us", "M", "mode"}.
"""
from __future__ import annotations

import statistics

import click
import numpy as np
from rich.console import Console
from rich.table import Table

from ddtree.cli_types import FiniteFloatRange
from ddtree.errors import InputError, reported
from ddtree.jsonout import emit_json
from ddtree.parallel.nccl_group import NcclGroup, new_unique_id, version
from ddtree.parallel.spawn_ranks import run_ranks
from ddtree.plugins.allreduce import VECTOR, OneShotAllReduce, can_access_peer, ipc_handle, limits, open_ipc
from ddtree.plugins.device import Gpu, _driver, check, ptr
from ddtree.runtime.cuda_executor import gpu_unavailable
from ddtree.runtime.engine import DeviceUnavailableError

IMPLS = ("one-shot", "one-shot-pull", "two-shot", "nccl")   # one-shot: the push protocol; two-shot: the same buffer
                                                            # (plugins/allreduce.py)
FILL_MASK, FILL_OR = 0x807F807F, 0x3F003F00     # bf16 pairs of random sign and mantissa in [0.5, 1)


def parse_flags(sizes: str, hidden: int, impls: str, gpus: str, replays: int, collectives: int) -> tuple:
    """(sizes, impls, gpus) from the flags, or an InputError naming the flag."""

    def ints(flag: str, text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise InputError(f"{flag}: expected comma-separated integers, got {text!r}") from None
        if not values:
            raise InputError(f"{flag}: expected at least one integer, got {text!r}")
        return values

    ms = ints("--sizes", sizes)
    if min(ms) < 1:
        raise InputError(f"--sizes: every M must be >= 1, got {ms}")
    if hidden < VECTOR or hidden % VECTOR:
        raise InputError(f"--hidden: must be a positive multiple of {VECTOR} (16-byte vectors of bf16), got {hidden}")
    names = [v.strip() for v in impls.split(",") if v.strip()]
    unknown = [v for v in names if v not in IMPLS]
    if unknown or not names:
        raise InputError(f"--impl: expected a comma-separated subset of {list(IMPLS)}, got {impls!r}")
    ids = ints("--gpu", gpus)
    if len(ids) < 2 or len(set(ids)) != len(ids) or min(ids) < 0 or len(ids) > limits()[0]:
        raise InputError(f"--gpu: expected 2..{limits()[0]} distinct GPU ids, got {gpus!r}")
    for flag, value in (("--replays", replays), ("--collectives", collectives)):
        if value < 1:
            raise InputError(f"{flag}: must be >= 1, got {value}")
    return ms, names, ids


def _replays_ms(gpu, graph, replays: int) -> float:
    """Median ms of `replays` back-to-back replays, an event between each (one sync at the end)."""
    from cuda.core import EventOptions  # cuda: the cuda extra
    opts = EventOptions(timing_enabled=True)
    events = [gpu.stream.record(options=opts)]
    for _ in range(replays):
        gpu.replay(graph)
        events.append(gpu.stream.record(options=opts))
    events[-1].sync()
    return statistics.median(b - a for a, b in zip(events, events[1:]))


def probe_rank(link, gpu_id: int) -> dict:
    """What this rank's GPU allows with the others (see the module doc)."""
    gpu = Gpu(gpu_id)
    driver = _driver()
    ids = link.all_exchange(gpu_id)
    out = {"rank": link.rank, "gpu": gpu_id, "name": gpu.name, "can_access_peer": {}, "p2p": {}}
    attrs = driver.CUdevice_P2PAttribute
    for other in ids:
        if other == gpu_id:
            continue
        out["can_access_peer"][other] = can_access_peer(gpu_id, other)
        out["p2p"][other] = {name: int(check(driver.cuDeviceGetP2PAttribute(getattr(attrs, attr), driver.CUdevice(gpu_id),
                                                                            driver.CUdevice(other)), attr))
                             for name, attr in (("performance_rank", "CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK"),
                                                ("access", "CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED"),
                                                ("native_atomics", "CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED"))}
    flags = gpu.zeros(64, np.uint64)            # [0] my flag, [8] error, [16] ns
    gpu.sync()
    handles = link.all_exchange(ipc_handle(flags.ptr))
    if link.rank < 2:
        peer = open_ipc(handles[1 - link.rank])
        out["ipc_open"] = True
        link.all_exchange("opened")
        k = gpu.kernel("allreduce.cu", "allreduce_pingpong")
        rounds = 1000
        gpu.launch(k, 1, 32, 0, ptr(flags), np.uint64(peer), np.int32(link.rank == 0), np.uint64(0),
                   np.uint32(rounds), np.uint32(50_000_000), np.uint64(flags.ptr + 64), ptr(flags.ptr + 128))
        host = flags.numpy()
        out["flag_handshake"] = {"ok": int(host[8]) == 0, "rounds": rounds,
                                 "round_trip_ns": int(host[16]) if link.rank == 0 else None}
    else:
        link.all_exchange("opened")
    return out


def bench_rank(link, gpu_id: int, ms: list[int], hidden: int, impls: list[str], replays: int, collectives: int) -> dict:
    """One rank's measurements (every rank runs the same graphs; rank 0's rows are reported)."""
    gpu = Gpu(gpu_id)
    max_elems = max(ms) * hidden
    ar = OneShotAllReduce(gpu, link.rank, link.nranks, max_elems)
    ar.connect(link.all_exchange(ar.ipc_handle()))
    pull = None
    if "one-shot-pull" in impls:
        pull = OneShotAllReduce(gpu, link.rank, link.nranks, max_elems, protocol="pull")
        pull.connect(link.all_exchange(pull.ipc_handle()))
    nccl = None
    if "nccl" in impls:
        uid = link.all_exchange(new_unique_id() if link.rank == 0 else None)[0]
        nccl = NcclGroup(gpu, uid, link.rank, link.nranks)
    xs = [gpu.alloc(max_elems, np.uint16) for _ in range(2)]
    fill = gpu.kernel("fill.cu", "fill_hash_u32")
    rows = []
    for M in ms:
        elems = M * hidden

        def reduce_one(stream, impl, i=0):
            x = xs[i % 2]
            if impl == "one-shot":
                ar(x, x, elems, stream=stream)
            elif impl == "one-shot-pull":
                pull(x, x, elems, stream=stream)
            elif impl == "two-shot":
                ar(x, x, elems, stream=stream, protocol="two-shot")
            else:
                nccl.all_reduce(x, x, elems, stream=stream)

        def fill_one(stream, i):
            gpu.launch(fill, max(1, min(264, elems // 512)), 256, 0, ptr(xs[i % 2]), np.uint64(elems // 2),
                       np.uint32(i), np.uint32(FILL_MASK), np.uint32(FILL_OR), stream=stream)

        kernels_only = gpu.capture(lambda s: [fill_one(s, i) for i in range(collectives)])
        for impl in impls:
            alone = gpu.capture(lambda s: reduce_one(s, impl))
            chain = gpu.capture(lambda s: [(fill_one(s, i), reduce_one(s, impl, i)) for i in range(collectives)])
            for g in (alone, chain):
                gpu.replay(g)
            gpu.sync()
            link.all_exchange("warm")
            alone_us = _replays_ms(gpu, alone, replays) * 1e3
            link.all_exchange("alone")
            chain_us = _replays_ms(gpu, chain, 7) * 1e3
            base_us = _replays_ms(gpu, kernels_only, 7) * 1e3
            base = {"impl": impl, "ranks": link.nranks, "bytes": 2 * elems, "M": M}
            rows.append({**base, "mode": "alone", "us": round(alone_us, 2)})
            rows.append({**base, "mode": "in_graph", "us": round((chain_us - base_us) / collectives, 2),
                         "graph_us": round(chain_us, 1), "kernels_only_us": round(base_us, 1)})
    gpu.sync()
    errors = sorted(set(ar.error_ranks()) | set(pull.error_ranks() if pull is not None else []))
    info = {"rank": link.rank, "rows": rows, "one_shot_errors": errors, "gpu": gpu.name,
            "nccl_version": version() if nccl is not None else None}
    if nccl is not None:
        nccl.close()
    ar.close()
    if pull is not None:
        pull.close()
    return info


def faster_from(rows: list[dict], impl: str, than: str) -> int | None:
    """The smallest message (bytes) from which `impl` beat `than` inside the graph at every measured size (where a
    PCIe model's crossover should be on this machine; parallel/collective_models.py), None if it never did."""
    times = {}
    for row in rows:
        if row["mode"] == "in_graph":
            times.setdefault(row["bytes"], {})[row["impl"]] = row["us"]
    sizes = sorted(b for b, t in times.items() if than in t and impl in t)
    wins = [times[b][impl] < times[b][than] for b in sizes]
    for i, b in enumerate(sizes):
        if all(wins[i:]):
            return b
    return None


def nccl_faster_from(rows: list[dict]) -> int | None:
    """The smallest message from which NCCL beat the one-shot (push) in the graph at every measured size."""
    return faster_from(rows, "nccl", "one-shot")


@click.command("allreduce")
@click.option("--sizes", default="1,17,65", show_default=True, help="rows M of the M x hidden bf16 messages")
@click.option("--hidden", default=7168, show_default=True, help="row width (Kimi K2.6: 7168)")
@click.option("--impl", "impls", default="one-shot,nccl", show_default=True, help="implementations to time")
@click.option("--gpu", "gpus", default="0,1", show_default=True,
              help="one rank process per GPU index, comma-separated (as ddtree-run --gpu for a tp N engine)")
@click.option("--replays", default=50, show_default=True, help="replays of the one-all-reduce graph")
@click.option("--collectives", default=122, show_default=True, help="all-reduces in the in-graph chain")
@click.option("--probe", is_flag=True, help="report peer access, IPC and the flag round trip instead")
@click.option("--timeout-s", default=600.0, show_default=True, type=FiniteFloatRange(min=1.0),
              help="a rank still running after this long prints its Python stacks (stderr) and the run fails")
@click.option("--json", "as_json", is_flag=True, help="one JSON object on stdout")
def allreduce_command(sizes, hidden, impls, gpus, replays, collectives, probe, timeout_s, as_json):
    """One-shot peer-to-peer all-reduce (push, pull, two-shot) vs NCCL, alone and inside a graph of 122."""
    with reported():
        ms, names, ids = parse_flags(sizes, hidden, impls, gpus, replays, collectives)
        for g in sorted(set(ids)):          # said before any rank process starts (each would fail on its own)
            why = gpu_unavailable(g)
            if why:
                raise DeviceUnavailableError(f"bench allreduce --gpu {gpus}: GPU {g} is not available: {why}")
    if probe:
        result = {"probe": run_ranks(probe_rank, ids, timeout_s=timeout_s)}
        if as_json:
            emit_json(result)
        else:
            click.echo(result)
        return
    infos = run_ranks(bench_rank, ids, args=(ms, hidden, names, replays, collectives), timeout_s=timeout_s)
    result = {"gpu": infos[0]["gpu"], "ranks": len(ids), "nccl_version": infos[0]["nccl_version"],
              "one_shot_errors": sorted({r for i in infos for r in i["one_shot_errors"]}), "rows": infos[0]["rows"],
              "nccl_faster_from_bytes": nccl_faster_from(infos[0]["rows"]),
              "two_shot_faster_from_bytes": faster_from(infos[0]["rows"], "two-shot", "one-shot")}
    if as_json:
        emit_json(result)
        return
    table = Table(title=f"all-reduce on {len(ids)} x {result['gpu']} (NCCL {result['nccl_version']})")
    for col in ("impl", "M", "bytes", "mode", "us"):
        table.add_column(col)
    for row in result["rows"]:
        table.add_row(*(str(row[c]) for c in ("impl", "M", "bytes", "mode", "us")))
    Console(stderr=True).print(table)
