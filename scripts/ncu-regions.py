#!/usr/bin/env python3
"""Split one kernel's warp-stall samples by how often each SASS instruction ran, from an
`ncu --page source --print-source sass --csv` export (scripts/gpu-run.sh profile with PROFILE_SOURCE=1 leaves it
as ncu-<family>-source.csv.gz in the results archive). Instructions every warp runs once (prologue, epilogue) and
the loop body (run once per tile) separate cleanly, so this shows how much of a kernel's time sits in code that
runs once per warp - where straight-line code pays an instruction fetch per instruction (`no_inst` stalls).
usage: ncu-regions.py <source.csv[.gz]> <kernel name> [min loop count, default 7000]"""
import collections, csv, gzip, sys

path, kernel = sys.argv[1], sys.argv[2]
loop_min = int(sys.argv[3]) if len(sys.argv) > 3 else 7000
opener = gzip.open if path.endswith(".gz") else open
rows, cur, hdr = [], None, None
with opener(path, "rt", newline="") as f:
    for row in csv.reader(f):
        if not row:
            continue
        if row[0] == "Kernel Name":
            cur, hdr = row[1], None
            continue
        if row[0] == "Address":
            hdr = row
            continue
        if cur == kernel and hdr and len(row) == len(hdr):
            rows.append(dict(zip(hdr, row)))
seen, first = set(), []  # the first launch of the kernel only: its addresses repeat for later launches
for r in rows:
    if r["Address"] in seen:
        break
    seen.add(r["Address"])
    first.append(r)
rows = first
if not rows:
    sys.exit(f"no rows for kernel {kernel} in {path}")
samples = lambda r: int(r["Warp Stall Sampling (All Samples)"] or 0)
execd = lambda r: int(r["Instructions Executed"] or 0)
total = sum(map(samples, rows)) or 1
stall_cols = [c for c in rows[0] if c.startswith("stall_") and "(Not Issued)" not in c]
loop = [i for i, r in enumerate(rows) if execd(r) >= loop_min]
lo, hi = (min(loop), max(loop) + 1) if loop else (len(rows), len(rows))
print(f"{kernel}: {len(rows)} SASS instructions, {total} warp-stall samples; loop = instructions run >= {loop_min} times")
for name, (a, b) in [("before the loop", (0, lo)), ("loop", (lo, hi)), ("after the loop", (hi, len(rows)))]:
    part = rows[a:b]
    reasons = collections.Counter()
    for r in part:
        for c in stall_cols:
            reasons[c[6:]] += int(r[c] or 0)
    share = 100 * sum(map(samples, part)) / total
    top = ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in reasons.most_common(4) if v)
    print(f"  {name:16s} {len(part):6d} instructions, {share:5.1f}% of samples ({top})")
