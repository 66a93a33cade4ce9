#!/usr/bin/env python3
"""Summarize an `ncu --page source --print-source sass --csv` export (scripts/gpu-run.sh profile with PROFILE_SOURCE=1):
per kernel (first launch of each name), the warp-stall samples by reason and the hottest SASS instructions with
their dominant stall reasons. usage: ncu-hot.py <source.csv> [top N]"""
import csv, sys, collections
path = sys.argv[1]; top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
kernels = []; cur = None; hdr = None
with open(path, newline='') as f:
    for row in csv.reader(f):
        if not row: continue
        if row[0] == 'Kernel Name':
            cur = {'name': row[1], 'rows': []}; kernels.append(cur); hdr = None; continue
        if row[0] == 'Address': hdr = row; continue
        if cur is not None and hdr is not None and len(row) == len(hdr):
            cur['rows'].append(dict(zip(hdr, row)))
seen = set()
for k in kernels:
    if k['name'] in seen or not k['rows']: continue
    seen.add(k['name'])
    rows = k['rows']
    stall_cols = [c for c in rows[0] if c.startswith('stall_') and '(Not Issued)' not in c]
    tot = collections.Counter()
    for r in rows:
        for c in stall_cols:
            try: tot[c] += int(r[c])
            except ValueError: pass
    allS = sum(tot.values()) or 1
    print(f"=== {k['name']}: {len(rows)} SASS instructions, {allS} warp-stall samples")
    print("  by reason: " + ", ".join(f"{c[6:]} {100*v/allS:.1f}%" for c, v in tot.most_common(8) if v))
    def samples(r):
        try: return int(r['Warp Stall Sampling (All Samples)'])
        except ValueError: return 0
    idx = {id(r): i for i, r in enumerate(rows)}
    for r in sorted(rows, key=samples, reverse=True)[:top]:
        s = samples(r)
        if not s: break
        reasons = sorted(((int(r[c]) if r[c].isdigit() else 0, c[6:]) for c in stall_cols), reverse=True)[:3]
        rs = " ".join(f"{n}:{100*v/s:.0f}%" for v, n in reasons if v)
        print(f"  #{idx[id(r)]:5d} {100*s/allS:5.2f}%  {r['Source'].strip()[:70]:70s} execd={r['Instructions Executed']:>8s}  {rs}")
    print()
