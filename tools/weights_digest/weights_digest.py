#!/usr/bin/python3
"""Prints the weights digest a pdworker publishes for a checkpoint.

An independent implementation (standard library and python3-xxhash) of the tree digest
that worker/model/model_fingerprint.h specifies, so a checkpoint's digest
can be checked without starting a worker, and so the C++ hashing is tested
against the written spec (tests/model/model_fingerprint_test.cc):

  leaves: each tensor's bytes in 16 MiB chunks, leaf = XXH3-128(chunk),
          16 bytes big-endian (xxhash's canonical digest())
  digest: SHA-256("pdworker-weights-v3;chunk=16777216;" + for every tensor
          in name order: "<len(name)>:<name>;<dtype>;<dims>;<bytes>;" + its
          leaves)

Usage: weights_digest.py MODEL_DIR [--threads N]
"""

import argparse
import concurrent.futures
import hashlib
import json
import mmap
import os
import struct
import sys

import xxhash

SCHEME = "pdworker-weights-v3"
CHUNK_BYTES = 16 << 20


def read_file(path):
    """{name: (dtype, shape, memoryview of its bytes)} of one safetensors file."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    (header_size,) = struct.unpack("<Q", mapped[:8])
    header = json.loads(mapped[8:8 + header_size])
    data = memoryview(mapped)[8 + header_size:]
    return {name: (info["dtype"], info["shape"],
                   data[info["data_offsets"][0]:info["data_offsets"][1]])
            for name, info in header.items() if name != "__metadata__"}


def tensors(model_dir):
    """(name, dtype, shape, bytes) for every tensor the worker loads: with
    model.safetensors.index.json those its weight_map lists (each from its
    shard), otherwise all of model.safetensors (worker/model/checkpoint.cc)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = {shard: read_file(os.path.join(model_dir, shard))
                 for shard in set(weight_map.values())}
        found = {name: files[shard][name] for name, shard in weight_map.items()}
    else:
        found = read_file(os.path.join(model_dir, "model.safetensors"))
    # Python orders str by code point, which is UTF-8 byte order: the same
    # order as the worker's std::string names.
    return [(name,) + found[name] for name in sorted(found)]


def weights_digest(model_dir, threads):
    entries = tensors(model_dir)
    chunks = [data[at:at + CHUNK_BYTES]
              for _, _, _, data in entries
              for at in range(0, len(data), CHUNK_BYTES)]
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        leaves = iter(list(pool.map(
            lambda chunk: xxhash.xxh3_128(chunk).digest(), chunks)))
    root = hashlib.sha256(f"{SCHEME};chunk={CHUNK_BYTES};".encode())
    for name, dtype, shape, data in entries:
        encoded = name.encode()
        root.update(b"%d:%s;%s;%s;%d;" % (
            len(encoded), encoded, dtype.encode(),
            ",".join(str(d) for d in shape).encode(), len(data)))
        for _ in range(0, len(data), CHUNK_BYTES):
            root.update(next(leaves))
    return root.hexdigest()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    print(weights_digest(args.model_dir, args.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
