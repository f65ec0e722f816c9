#!/usr/bin/env python3
"""Compare two scripts/bench/sims.sh output folders table by table,
ignoring the timing columns (decisions/s, sched %, wall s, setup s) and
the work counters (visits/decision: how many children a decision
examined, which a faster search changes without changing the decision).

    scripts/bench/cmp.py A B

Prints 'identical' per workload, or the rows that differ; the work
counters that differ are printed after, for information."""
import os, re, sys

TIMING = ("decisions/s", "sched %", "wall s", "setup s")
WORK = ("visits/decision",)

def rows(path, skip=TIMING + WORK):
    """The table rows of a result file, without the `skip` columns: each
    table's first row is its header, which says which columns to drop."""
    out, keep = [], None
    for line in open(path):
        line = line.rstrip("\n")
        if not line.startswith("|"):
            keep = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if keep is None:
            keep = [i for i, c in enumerate(cells) if c not in skip]
        elif set("".join(cells)) <= set("-: "):
            continue
        out.append(tuple(cells[i] for i in keep if i < len(cells)))
    return out

a, b = sys.argv[1], sys.argv[2]
same = True
for name in sorted(f for f in os.listdir(a) if f.endswith(".txt")):
    pa, pb = os.path.join(a, name), os.path.join(b, name)
    if not os.path.exists(pb):
        print(f"{name}: missing in {b}"); same = False; continue
    ra, rb = rows(pa), rows(pb)
    if ra == rb:
        print(f"{name}: identical ({len(ra)} rows)")
        wa, wb = rows(pa, TIMING), rows(pb, TIMING)
        for x, y in zip(wa, wb):
            if x != y:
                print("  work counters differ:"); print("    A:", " | ".join(x)); print("    B:", " | ".join(y))
    else:
        same = False
        print(f"{name}: DIFFERS")
        for x, y in zip(ra, rb):
            if x != y:
                print("  A:", " | ".join(x)); print("  B:", " | ".join(y))
        if len(ra) != len(rb):
            print(f"  rows {len(ra)} vs {len(rb)}")
sys.exit(0 if same else 1)
