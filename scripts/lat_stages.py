#!/usr/bin/env python3
"""Per-step submit -> start latency from the `lat` debug events (issue 14).

Run e2e-throughput with the events on and its logs kept:
    E2E_RUST_LOG=info,lat=debug E2E_KEEP_DIR=1 target/release/e2e-throughput 2000
then:  scripts/lat_stages.py LOG_DIR FIRST_PACED_JOB_NUMBER   (2001 for 2000 jobs)
Prints p50 / p90 / p99 / max in ms of each step for the paced jobs, and the
store commits' durations during the paced phase.
"""
import re,sys,glob,datetime
d=sys.argv[1]; lo=int(sys.argv[2]) if len(sys.argv)>2 else 2001
ansi=re.compile(r'\x1b\[[0-9;]*m')
def ts(s): return datetime.datetime.strptime(s[:26],'%Y-%m-%dT%H:%M:%S.%f').timestamp()*1e3
ev={}
def put(job,st,t):
    ev.setdefault(job,{}).setdefault(st,t)
for f in sorted(glob.glob(d+'/*.log')):
    last_rpc=None
    for line in open(f,errors='replace'):
        line=ansi.sub('',line)
        if ' lat: ' not in line: continue
        t=ts(line.split()[0]); msg=line.split(' lat: ',1)[1].strip()
        if msg.startswith('submit rpc received'): last_rpc=t; continue
        m=re.match(r'submit applied first=j-(\d+) last=j-(\d+)',msg)
        if m:
            for n in range(int(m.group(1)),int(m.group(2))+1):
                put(n,'rpc',last_rpc); put(n,'applied',t)
            continue
        m=re.match(r'(.*?) job="?j-(\d+)',msg)
        if m: put(int(m.group(2)),m.group(1),t)
order=['rpc','applied','assign sealed','assign sent','assign received','start task spawned','started']
def pct(v,q):
    v=sorted(v); return v[min(len(v)-1,int(q*len(v)))] if v else float('nan')
jobs=[j for j in ev if j>=lo and all(s in ev[j] for s in order)]
if not jobs:
    sys.exit("no paced job with every step in "+d)
print(f"{len(jobs)} jobs with every stage (ms; p50 / p90 / p99 / max)")
for a,b in zip(order,order[1:]):
    v=[ev[j][b]-ev[j][a] for j in jobs]
    print(f"{a:>20} -> {b:<20} {pct(v,.5):7.2f} {pct(v,.9):7.2f} {pct(v,.99):7.2f} {max(v):7.2f}")
v=[ev[j]['started']-ev[j]['rpc'] for j in jobs]
print(f"{'rpc -> started':>43} {pct(v,.5):7.2f} {pct(v,.9):7.2f} {pct(v,.99):7.2f} {max(v):7.2f}")
v=[ev[j]['started']-ev[j]['applied'] for j in jobs]
print(f"{'applied -> started':>43} {pct(v,.5):7.2f} {pct(v,.9):7.2f} {pct(v,.99):7.2f} {max(v):7.2f}")
# the agent's start path, step by step (the executor's events, where logged)
fine=['start task spawned','dir made','cgroup made','record written','start line sent','supervisor ok read','start answer taken','started']
fj=[j for j in jobs if all(s in ev[j] for s in fine)]
if fj:
    print(f"agent start path, {len(fj)} jobs:")
    for a,b in zip(fine,fine[1:]):
        v=[ev[j][b]-ev[j][a] for j in fj]
        print(f"{a:>20} -> {b:<20} {pct(v,.5):7.2f} {pct(v,.9):7.2f} {pct(v,.99):7.2f} {max(v):7.2f}")
# the worst 10 jobs per stage
w=sorted(jobs,key=lambda j: ev[j]['started']-ev[j]['applied'])[-8:]
for j in w: print(j,[round(ev[j][b]-ev[j][a],1) for a,b in zip(order,order[1:])])
slow=[j for j in jobs if ev[j]['assign sealed']-ev[j]['applied']>2]
print("sealed >2ms after applied:",len(slow), sorted(slow)[:40])
# commit durations over the paced phase
cm=[]
for f in glob.glob(d+'/dispatcher-*.log'):
    for line in open(f,errors='replace'):
        line=ansi.sub('',line)
        m=re.search(r' lat: committed writes=(\d+) us=(\d+)',line)
        if m: cm.append((ts(line.split()[0]),int(m.group(1)),int(m.group(2))/1000))
t0=min(ev[j]['applied'] for j in jobs)
c=[x[2] for x in cm if x[0]>=t0] or [float('nan')]
print(f"commits during the paced phase: {len(c)}, ms p50 {pct(c,.5):.2f} p90 {pct(c,.9):.2f} p99 {pct(c,.99):.2f} max {max(c):.2f}")
v=[ev[j]['assign received']-ev[j]['assign sent'] for j in jobs]
print("sent->received in 36-46 ms:", sum(1 for x in v if 36<=x<=46), "of", len(v), "; >20 ms:", sum(1 for x in v if x>20))
