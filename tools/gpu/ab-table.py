#!/usr/bin/env python3
"""Gathers the bench-engine runs of one call (pending-runs.sh's ab, ab-checks and option groups:
files bench-engine-NAME-REP.txt) into one table: for each NAME, the step's median ms at each batch
size, every repetition side by side, and where the run had them the steps without checks and the
checks' cost. A build's or an option's runs then read as one line.

Usage: ab-table.py DIR [--json FILE]
"""
import argparse
import json
import os
import re
import sys
from collections import defaultdict


def parse(path):
    """{batch: {"step_ms": x, "unchecked_ms": y or None}} from a bench-engine table."""
    rows = {}
    with open(path, errors="replace") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 7 or not fields[0].isdigit():
                continue
            try:
                batch, step = int(fields[0]), float(fields[2])
            except ValueError:
                continue
            unchecked = None
            if len(fields) >= 12:  # with the comparison columns: unchecked_ms is the eighth
                try:
                    unchecked = float(fields[7])
                except ValueError:
                    pass
            rows[batch] = {"step_ms": step, "unchecked_ms": unchecked}
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--json")
    args = ap.parse_args()
    runs = defaultdict(dict)  # name -> rep -> rows
    for root, _, files in os.walk(args.dir):
        for name in sorted(files):
            m = re.fullmatch(r"bench-engine-(.+)-(\d+)\.txt", name)
            if not m:
                continue
            rows = parse(os.path.join(root, name))
            if rows:
                runs[m.group(1)][int(m.group(2))] = rows
    if not runs:
        sys.exit("no bench-engine tables (bench-engine-NAME-REP.txt) under " + args.dir)
    batches = sorted({b for reps in runs.values() for rows in reps.values() for b in rows})
    width = max(len(n) for n in runs)
    print(f"{'run':<{width}}  " + "  ".join(f"{'b' + str(b) + ' ms':>17}" for b in batches))
    for name in sorted(runs):
        reps = runs[name]

        def cell(b, key):
            values = [reps[r][b][key] for r in sorted(reps) if b in reps[r] and reps[r][b][key]]
            return " / ".join(f"{v:.3f}" for v in values) if values else "-"

        print(f"{name:<{width}}  " + "  ".join(f"{cell(b, 'step_ms'):>17}" for b in batches))
        if any(reps[r][b]["unchecked_ms"] for r in reps for b in reps[r]):
            label = "  unchecked"
            print(f"{label:<{width}}  " +
                  "  ".join(f"{cell(b, 'unchecked_ms'):>17}" for b in batches))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({n: {str(r): rows for r, rows in reps.items()} for n, reps in runs.items()},
                      f, indent=1)


if __name__ == "__main__":
    main()
