#!/usr/bin/env python3
"""Writes the comparison prompts: random token ids of fixed lengths.

  make_prompts.py --vocab 128256 --out prompts.json [--seed 0]

Lengths 1, 7, 64, 300 and 1000 (override with --lengths): a single token
(no attention history at all), a short prompt, exactly one typical capture
/ block boundary, and two long prompts whose positions reach the RoPE ranges
where a wrong base or llama3 scaling shows. Ids are uniform in [0, vocab)
from numpy's PCG64 with the given seed, so the file is the same everywhere.
Output: {"prompts": [[ids], ...], "seed": S, "vocab": V}.
"""

import argparse
import json
import sys

import numpy as np


def make_prompts(vocab, lengths, seed):
    """list of lists of Python ints, one per length, in order."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, size=n)] for n in lengths]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lengths", default="1,7,64,300,1000")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    if args.vocab <= 0 or any(n <= 0 for n in lengths):
        p.error("--vocab and every length must be positive")
    prompts = make_prompts(args.vocab, lengths, args.seed)
    with open(args.out, "w") as f:
        json.dump({"prompts": prompts, "seed": args.seed,
                   "vocab": args.vocab}, f)
    print("make_prompts: %d prompts of lengths %s -> %s" %
          (len(prompts), lengths, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
