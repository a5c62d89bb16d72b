"""PyTorch SDPA causal attention TFLOP/s on the shapes of
bench/prefill_attention_bench.cc (issue 22): one prompt of N tokens, 32
query heads over 8 kv heads, head dims 64 and 128, bf16.

  python3 bench/torch_compare/sdpa_bench.py [--tokens 1024,...]
      [--head_dims 64,128] [--jsonl FILE --commit SHA]

K and V are expanded to the 32 query heads before timing (so every SDPA
backend, FlashAttention-2 and cuDNN included, is eligible; the expansion is
not timed). FLOPs: 4 * heads * head_dim * N(N+1)/2, as the C++ bench.
Time: median of 5 CUDA-event-timed runs of `launches` back-to-back calls.
Prints a Markdown table with the backend PyTorch picked.
"""
import argparse
import datetime
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, KV_HEADS = 32, 8


def time_us(fn, launches):
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(launches):
            fn()
        stop.record()
        stop.synchronize()
        runs.append(start.elapsed_time(stop) * 1000.0 / launches)
    runs.sort()
    return runs[len(runs) // 2]


def measure(d, n):
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.rand(1, HEADS, n, d, device="cuda", generator=g) * 2 - 1
    k = torch.rand(1, KV_HEADS, n, d, device="cuda", generator=g) * 2 - 1
    v = torch.rand(1, KV_HEADS, n, d, device="cuda", generator=g) * 2 - 1
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1).contiguous()
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1).contiguous()
    launches = 5 if n >= 8192 else 20
    flops = 4.0 * HEADS * d * n * (n + 1) / 2
    results = {}
    for name, backend in [("default", None),
                          ("flash", SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
        def fn():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        try:
            if backend is None:
                us = time_us(fn, launches)
            else:
                with sdpa_kernel([backend]):
                    us = time_us(fn, launches)
            results[name] = flops / us / 1e6
        except Exception as e:  # a backend that refuses the shape
            results[name] = None
            print(f"# d={d} n={n} {name}: {type(e).__name__}: {e}"[:200])
    return results


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1024,2048,4096,8192,16384")
    p.add_argument("--head_dims", default="64,128")
    p.add_argument("--jsonl", default="")
    p.add_argument("--commit", default="")
    a = p.parse_args()
    gpu = torch.cuda.get_device_name()
    rows = []
    for d in [int(x) for x in a.head_dims.split(",")]:
        for n in [int(x) for x in a.tokens.split(",")]:
            rows.append((d, n, measure(d, n)))
    print(f"device: {gpu}; torch {torch.__version__}; SDPA causal, "
          f"{HEADS} heads (kv expanded from {KV_HEADS}), bf16\n")
    print("| head_dim | tokens | default TFLOP/s | flash | cudnn |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    fmt = lambda x: "" if x is None else f"{x:.1f}"
    for d, n, r in rows:
        print(f"| {d} | {n} | {fmt(r['default'])} | {fmt(r['flash'])} | "
              f"{fmt(r['cudnn'])} |")
    if a.jsonl:
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        with open(a.jsonl, "a") as f:
            for d, n, r in rows:
                for name, system in [("default", "torch_sdpa"),
                                     ("flash", "torch_sdpa_flash"),
                                     ("cudnn", "torch_sdpa_cudnn")]:
                    if r[name] is None:
                        continue
                    f.write(json.dumps({
                        "date": date, "gpu": gpu, "commit": a.commit,
                        "metric": "attention_tflops",
                        "shape": f"h{HEADS}_kv{KV_HEADS}_d{d}",
                        "system": system, "batch": 1, "tokens": n,
                        "context": n, "value": round(r[name], 2)}) + "\n")


if __name__ == "__main__":
    main()
