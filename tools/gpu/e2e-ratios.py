#!/usr/bin/env python3
"""End-to-end tokens/s against in-process tokens/s at the same batch: serve-bench's JSON (through
a broker, one row per concurrency and sampling mode) over bench-engine's JSON (the worker's
backend alone, one row per batch size). Prints a table; the CUDA backend's end-to-end target is
85% in every cell.

Usage: e2e-ratios.py BENCH_ENGINE_JSON SERVE_BENCH_JSON [...]  (one bench-engine report, then
one or more serve-bench reports of the same model)
"""
import json
import sys


def main(argv):
    if len(argv) < 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        engine = json.load(f)
    engine_tok_s = {int(r["batch"]): float(r["tokens_per_s"]) for r in engine["results"]}
    print(f"{'report':<40} {'concurrency':>11} {'sampling':>10} {'e2e tok/s':>10} "
          f"{'engine tok/s':>12} {'ratio':>7}")
    for path in argv[2:]:
        with open(path) as f:
            serve = json.load(f)
        for r in serve["results"]:
            c = int(r["concurrency"])
            e2e = float(r["tokens_per_s"])
            if c not in engine_tok_s:
                print(f"{path:<40} {c:>11} {r['sampling']:>10} {e2e:>10.1f} {'-':>12} {'-':>7}")
                continue
            ratio = e2e / engine_tok_s[c]
            print(f"{path:<40} {c:>11} {r['sampling']:>10} {e2e:>10.1f} "
                  f"{engine_tok_s[c]:>12.1f} {100 * ratio:>6.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
