#!/usr/bin/env python3
"""Compares logits written by `bulkhead logits` with Hugging Face transformers' float32 eager
forward pass over the same checkpoint and tokens. Prints one JSON line; exits 1 past tolerance.

  bulkhead logits --model DIR --tokens 1,5,9 --out L.f32
  tools/hf_compare.py --model DIR --tokens 1,5,9 --logits L.f32 [--tolerance 1e-4]
"""
import argparse
import json
import sys

import numpy as np
import torch
import transformers


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", required=True)
    p.add_argument("--logits", required=True)
    p.add_argument("--tolerance", type=float, default=1e-4)
    a = p.parse_args()
    tokens = [int(t) for t in a.tokens.split(",")]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        a.model, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0].numpy().astype(np.float32)
    got = np.fromfile(a.logits, dtype="<f4").reshape(want.shape)
    err = np.abs(got - want)
    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    argmax_equal = int((got.argmax(-1) == want.argmax(-1)).sum())
    report = {"model": a.model, "positions": len(tokens), "vocab": int(want.shape[1]),
              "max_abs_error": float(err.max()), "relative_error": rel,
              "argmax_agree": f"{argmax_equal}/{len(tokens)}",
              "transformers": transformers.__version__,
              "pass": bool(err.max() <= a.tolerance)}
    print(json.dumps(report))
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
