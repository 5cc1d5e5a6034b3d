"""Where a kernel's warps stall, from `ncu -i REP --page source --csv --print-source sass` (stdin), as small text.

    ncu -i rep.ncu-rep --page source --csv --print-source sass | python3 tests/plugins/ncu_source_top.py [N]

Per kernel of the report (once, though ncu prints each table twice): the stall reasons' shares of all samples, the
SASS lines with the most L2 sectors beyond the ideal, and the N lines with the most samples with their top reasons.
Unparsable input: its first lines as they are.
"""
import collections
import csv
import sys


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def summarize(lines: list[str], top: int) -> None:
    rows = list(csv.reader(lines))
    heads = [i for i, r in enumerate(rows) if "Address" in r and "Source" in r]
    if not heads:
        print("no source table found; first lines:")
        print("".join(lines[:60]))
        return
    seen = set()
    for n, h in enumerate(heads):
        head, end = rows[h], heads[n + 1] - 1 if n + 1 < len(heads) else len(rows)
        body = [r for r in rows[h + 1:end] if len(r) == len(head)]
        name = " ".join(rows[h - 1]).strip() if h > 0 else "?"
        if (name, len(body)) in seen:
            continue
        seen.add((name, len(body)))
        stalls = [i for i, c in enumerate(head) if c.startswith("stall_") and "Not Issued" not in c]
        totals = collections.Counter()
        for r in body:
            for i in stalls:
                totals[head[i][6:]] += number(r[i])
        total = sum(totals.values()) or 1.0
        print(f"# {name}: {len(body)} SASS lines, {total:.0f} stall samples")
        print("  reasons: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in totals.most_common(10)))
        src = head.index("Source")
        if "L2 Theoretical Sectors Global Excessive" in head:
            ex = head.index("L2 Theoretical Sectors Global Excessive")
            print("  most excessive L2 sectors:")
            for r in sorted(body, key=lambda r: -number(r[ex]))[:4]:
                print(f"    {r[ex]:>10s}  | {r[src].strip()[:80]}")
        print(f"  top {top} lines by samples:")
        for r in sorted(body, key=lambda r: -sum(number(r[i]) for i in stalls))[:top]:
            got = sorted(((number(r[i]), head[i][6:]) for i in stalls), reverse=True)[:3]
            share = 100 * sum(v for v, _ in got) / total
            print(f"    {share:4.1f}% {r[src].strip()[:64]:64s} " + " ".join(f"{k}:{v:.0f}" for v, k in got if v))
        print()


if __name__ == "__main__":
    summarize(sys.stdin.readlines(), int(sys.argv[1]) if len(sys.argv) > 1 else 40)
