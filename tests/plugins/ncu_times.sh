#!/usr/bin/env bash
# Per-kernel GPU times of profile_tree.py under ncu: bash tests/plugins/ncu_times.sh V B[,B..] [modes] [flat]
/usr/local/cuda/bin/ncu --csv --metrics gpu__time_duration.sum python3 tests/plugins/profile_tree.py "$@" 2>/dev/null \
  | python3 -c "
import csv, sys
rows = [r for r in csv.reader(sys.stdin) if len(r) > 10]
h = rows[0]; k, v, u = h.index('Kernel Name'), h.index('Metric Value'), h.index('Metric Unit')
for r in rows[1:]:
    print(f'{r[k][:24]:24s} {r[v]:>12s} {r[u]}')
"
