#!/usr/bin/env python3
"""Summarises a kernel timeline (tools/gpu/kernel_timeline.cpp's CSV): per CUDA graph, how long a
replay takes and, per kernel of the step, its median time on the device and the median gap from
the end of the kernel before it to its start (negative: it started before that one ended, as
programmatic launch allows). Kernels of one name are summed per replay, so a layer's 28 launches
show as one line; lines come largest effective time first.

A kernel's effective time is its end minus the latest end of the kernels before it in the replay
(0 where it ends before one of them): what it adds to the step, its programmatic overlap
excluded. The effective times of a step's kernels add up to the replay's span.

Usage: timeline.py TIMELINE.csv [--min-nodes N] [--graph ID] [--by-grid]
  --min-nodes N  only graphs of at least N kernels (default 50: whole steps, not small ones)
  --graph ID     only this graph, kernel by kernel in replay order
  --by-grid      a line per kernel and grid (a step's products of different shapes apart)
"""
import argparse
import csv
import re
import statistics
import sys
from collections import defaultdict


def short(name):
    """The kernel's own identifier from a mangled name, with its template's integer arguments."""
    i = 0
    while i < len(name):
        m = re.match(r"\d+", name[i:])
        if not m:
            i += 1
            continue
        j = i + len(m.group(0))
        ident = name[j:j + int(m.group(0))]
        if "ernel" in ident and re.fullmatch(r"[A-Za-z_]\w*", ident):
            targs = re.match(r"I((?:Li\d+E)+)", name[j + len(ident):])
            args = re.findall(r"Li(\d+)E", targs.group(1)) if targs else []
            return ident + ("<" + ",".join(args) + ">" if args else "")
        i = j + len(ident) if re.fullmatch(r"[A-Za-z_]\w*", ident or "-") else i + 1
    return name[:48]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--min-nodes", type=int, default=50)
    ap.add_argument("--graph", type=int)
    ap.add_argument("--by-grid", action="store_true")
    args = ap.parse_args()
    by_graph = defaultdict(list)
    with open(args.csv) as f:
        for r in csv.DictReader(f):
            g = int(r["graph"])
            if g == 0:
                continue  # launched outside a graph
            by_graph[g].append(r)
    if not by_graph:
        sys.exit("no kernels from graphs in " + args.csv)
    for g, rows in sorted(by_graph.items()):
        if args.graph is not None and g != args.graph:
            continue
        nodes = len({r["graph_node"] for r in rows})
        if nodes < args.min_nodes and args.graph is None:
            continue
        rows.sort(key=lambda r: int(r["start_ns"]))
        replays = [rows[i:i + nodes] for i in range(0, len(rows) - nodes + 1, nodes)]
        spans = [int(rp[-1]["end_ns"]) - int(rp[0]["start_ns"]) for rp in replays]
        print(f"graph {g}: {nodes} kernels, {len(replays)} replays, replay span median "
              f"{statistics.median(spans) / 1e3:.1f} us (first kernel's start to last one's end)")
        # Per replay: each kernel's time and its gap from the end of the one before it.
        per_name = defaultdict(lambda: defaultdict(list))
        detail = []
        def key_of(r):
            k = short(r["name"])
            return f"{k} {r['grid_x']}x{r['grid_y']}x{r['grid_z']}" if args.by_grid else k

        for rp in replays:
            sums = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
            latest_end = int(rp[0]["start_ns"])
            for i, r in enumerate(rp):
                dur = (int(r["end_ns"]) - int(r["start_ns"])) / 1e3
                gap = (int(r["start_ns"]) - int(rp[i - 1]["end_ns"])) / 1e3 if i > 0 else 0.0
                effective = max(0, int(r["end_ns"]) - latest_end) / 1e3
                latest_end = max(latest_end, int(r["end_ns"]))
                key = key_of(r)
                sums[key][0] += dur
                sums[key][1] += gap
                sums[key][2] += effective
                sums[key][3] += 1
                if args.graph is not None:
                    detail.append((i, key, r, dur, gap))
            for key, (dur, gap, effective, count) in sums.items():
                per_name[key]["dur"].append(dur)
                per_name[key]["gap"].append(gap)
                per_name[key]["effective"].append(effective)
                per_name[key]["count"].append(count)
        print(f"  {'kernel':56} {'launches':>8} {'us_a_replay':>11} {'gaps_us':>9} "
              f"{'effective':>9} {'grid':>14} {'dyn_smem':>8} {'smem_exec':>9} {'regs':>5}")
        first = {}
        for r in rows:
            first.setdefault(key_of(r), r)
        for key, v in sorted(per_name.items(),
                             key=lambda kv: -statistics.median(kv[1]["effective"])):
            r = first[key]
            grid = f"{r['grid_x']}x{r['grid_y']}x{r['grid_z']}"
            print(f"  {key[:56]:56} {statistics.median(v['count']):8.0f} "
                  f"{statistics.median(v['dur']):11.1f} {statistics.median(v['gap']):9.1f} "
                  f"{statistics.median(v['effective']):9.1f} {grid:>14} {r['dynamic_shared']:>8} "
                  f"{r['shared_executed']:>9} {r['registers']:>5}")
        if args.graph is not None:
            print("  kernel by kernel, first replay:")
            for i, key, r, dur, gap in detail[:nodes]:
                print(f"  {i:4} {key[:44]:44} {dur:9.1f} us  gap {gap:8.1f} us  "
                      f"grid {r['grid_x']}x{r['grid_y']}  smem_exec {r['shared_executed']}")


if __name__ == "__main__":
    main()
