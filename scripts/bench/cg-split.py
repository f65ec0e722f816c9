#!/usr/bin/env python3
"""The dispatcher's own cost around the engine, per submit + finish, from a
callgrind profile of the placement bench (scripts/bench/ours-per-submit.sh
writes one): the inclusive cost of Cluster::submit_as and ::job_status split
into the engine's subtrees (calls into sched::) and the rest, the rest listed
by function, exclusive. A callee's cost is shared out among its callers in
proportion to the calls (as gprof does), so deep rows are estimates.

  scripts/bench/cg-split.py OUTDIR/callgrind.NODES.out [ROWS]"""
import re, sys, collections
path = sys.argv[1]; top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
names = {}
def name(s):
    m = re.match(r"\((\d+)\)(?: (.*))?", s)
    if not m: return s
    if m.group(2) is not None: names[m.group(1)] = m.group(2)
    return names[m.group(1)]
selfc = collections.Counter(); calls = collections.defaultdict(collections.Counter); ncalls = collections.defaultdict(collections.Counter)
fn = None; pending = None
for line in open(path):
    line = line.rstrip("\n")
    if line.startswith("fn="): fn = name(line[3:]); continue
    if line.startswith("cfn="): cfn = name(line[4:]); continue
    if line.startswith("calls="): pending = (cfn, int(line[6:].split()[0])); continue
    if line[:1] in "0123456789+-*":
        parts = line.split()
        if len(parts) < 2: continue
        c = int(parts[1])
        if pending:
            calls[fn][pending[0]] += c; ncalls[fn][pending[0]] += pending[1]; pending = None
        else: selfc[fn] += c
    elif line.startswith(("fl=","fi=","fe=","cfi=","cfl=","ob=","cob=")):
        name(line.split("=",1)[1])
def short(n): return re.sub(r"\[.*", "", n).replace("dispatcher::cluster::", "").strip()
def incl(f): return selfc[f] + sum(c for g, c in calls[f].items() if g != f)
sub = [f for f in selfc.keys() | calls.keys() if re.search(r"Cluster>::submit_as$", short(f))][0]
js = [f for f in selfc.keys() | calls.keys() if re.search(r"Cluster>::job_status$", short(f))][0]
nsub = sum(ncalls[f][sub] for f in ncalls if sub in ncalls[f])
njs = sum(ncalls[f][js] for f in ncalls if js in ncalls[f])
excl = collections.Counter(); eng = collections.Counter()
def walk(f, scale, seen):
    excl[f] += scale * selfc[f]
    for g, c in calls[f].items():
        if g in seen or g == f: continue
        c *= scale
        if short(g).startswith("sched::"):
            eng[g] += c; continue
        gi = incl(g)
        if gi: walk(g, c / gi, seen | {g})
walk(sub, 1.0 / nsub, {sub}); walk(js, 1.0 / njs, {js})
tot = (incl(sub) / nsub + incl(js) / njs)
e = sum(eng.values()); o = sum(excl.values())
print(f"submits {nsub}  finishes {njs}  per submit+finish {tot:,.0f}: engine {e:,.0f}  rest {o:,.0f}")
print("-- rest, exclusive per submit+finish --")
for f, c in excl.most_common(top): print(f"{c:8,.0f}  {short(f)[:150]}")
print("-- engine entry points --")
for f, c in eng.most_common(12): print(f"{c:8,.0f}  {short(f)[:150]}")
