#!/usr/bin/env python3
"""Decode-step and prefill latency of the PyTorch baselines (issue 10).

  torch_bench.py --model DIR --out torch.json [--batches 1,2,...,256]
      [--prefill_lens 64,...,2048] [--context 512] [--reps 20]

Systems, all on the same checkpoint and batch shapes as pdworker's
gpu_decode_bench:
  eager       torch_llama's decode step (gpt-fast-style model, static KV
              cache, SDPA attention), launched op by op from Python.
  cuda_graph  the same step captured per batch size in a
              torch.cuda.CUDAGraph (the gpt-fast / vLLM recipe: static
              token/position/output tensors, warm-up on a side stream,
              capture largest batch first into one shared memory pool,
              replay after copying the inputs in).
  compile     torch.compile(mode="reduce-overhead") of the same step
              (Inductor kernels + CUDA graph trees). The first batch size is
              compiled static; later ones hit PyTorch's automatic-dynamic
              recompile. Any failure is recorded as an error string.
  hf_eager    transformers' own LlamaForCausalLM with its DynamicCache, as a
              reference for what an unoptimised Python server pays (fewer
              batch sizes: --hf_batches). Skipped when transformers is
              missing.

What one timed decode step includes (what a serving step pays): copying the
B input tokens and positions from pinned host memory to the device, the
forward, the argmax, and copying the B sampled tokens back (.cpu(), which
synchronises). Wall time by time.perf_counter; median of --reps steps after
--warmup. Each row writes its KV at positions context .. context+steps of
its own cache row, so attention reads ~context keys per row. The decode
cache is sized to context + steps (rounded up to 64), because this layout
attends over the whole allocated length with a mask.
Prefill: one batch-1 prompt of L tokens from an empty cache, logits of the
last position only, argmax, .cpu().

Capture: "seconds" for all decode batch sizes of a system (CUDA graph:
side-stream warm-up + capture; compile: compilation + graph recording on the
first calls), "memory_bytes" the drop in torch.cuda.mem_get_info()'s free
bytes across it (the device-level cost: graph pools, graph objects, cuBLAS
workspaces), "reserved_bytes" the torch.cuda.memory_reserved() delta.

Batch-1 HBM fraction: (decode weight bytes + KV bytes read) / step time /
peak. Weight bytes: every linear weight and norm, the LM head matrix and one
embedding row (tied embeddings: the matrix once, as LM head) -- the same
count as pdworker's. KV: K and V of all layers for the mean position of the
timed steps. Peak: H100 SXM 3.35e12 B/s, H100 PCIe 2.0e12, H100 NVL 3.9e12,
H200 4.8e12 from the device name, or --peak_tbps.

--device cpu runs eager (and hf_eager if transformers is importable) for
smoke tests; cuda_graph and compile are skipped with a note.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hf_util  # noqa: E402
import torch_llama  # noqa: E402

ALL_SYSTEMS = ("eager", "cuda_graph", "compile", "hf_eager")


# ----------------------------------------------------------------------------
# Device facts


def peak_bytes_per_s(name, override_tbps=0.0):
    """HBM peak in bytes/s from the device name (0.0 when unknown)."""
    if override_tbps > 0:
        return override_tbps * 1e12
    if "H200" in name:
        return 4.8e12
    if "H100" in name:
        if "PCIe" in name:
            return 2.0e12
        if "NVL" in name:
            return 3.9e12
        return 3.35e12  # SXM, HBM3
    return 0.0


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_snapshot(device):
    """(free device bytes, bytes reserved by torch's allocator)."""
    if device.type != "cuda":
        return 0, 0
    sync(device)
    return torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(
        device)


# ----------------------------------------------------------------------------
# Timing


def median_ms(step, warmup, reps):
    """Median wall time of step() in ms over reps calls after warmup.

    step() must end with a host synchronisation (ours end with .cpu()).
    """
    for i in range(warmup):
        step(i)
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        step(warmup + i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


class HostInputs:
    """Pinned host copies of the step inputs and the device buffers they
    are copied into (the graphs' static inputs)."""

    def __init__(self, max_batch, device, vocab):
        pin = device.type == "cuda"
        self.device = device
        self.tokens = torch.randint(0, vocab, (max_batch,),
                                    dtype=torch.int64).pin_memory() \
            if pin else torch.randint(0, vocab, (max_batch,))
        self.positions = torch.zeros(max_batch, dtype=torch.int64)
        if pin:
            self.positions = self.positions.pin_memory()
        self.dev_tokens = torch.zeros(max_batch, dtype=torch.int64,
                                      device=device)
        self.dev_positions = torch.zeros(max_batch, dtype=torch.int64,
                                         device=device)

    def upload(self, batch, position):
        """Host -> device copy of tokens/positions of rows [0, batch)."""
        self.positions[:batch].fill_(position)
        self.dev_tokens[:batch].copy_(self.tokens[:batch], non_blocking=True)
        self.dev_positions[:batch].copy_(self.positions[:batch],
                                         non_blocking=True)

    def feed_back(self, batch, sampled):
        """The sampled tokens become the next step's inputs."""
        self.tokens[:batch].copy_(sampled)


def decode_step_fn(model):
    """(tokens [B], positions [B]) -> argmax token ids [B] on the device."""
    def fn(tokens, positions):
        return model.decode_step(tokens, positions).argmax(-1)
    return fn


def prefill_fn(model):
    """tokens [1, L] -> argmax of the last position's logits [1]."""
    def fn(tokens):
        return model.prefill(tokens).argmax(-1)
    return fn


def time_decode(run, inputs, batch, context, warmup, reps):
    """Median ms of one serving decode step; run(batch) -> device tokens."""
    def step(i):
        inputs.upload(batch, context + i)
        out = run(batch).cpu()
        inputs.feed_back(batch, out)
    return median_ms(step, warmup, reps)


# ----------------------------------------------------------------------------
# Systems: decode


def bench_eager_decode(model, inputs, batches, a):
    fn = decode_step_fn(model)
    rows = []
    for b in batches:
        def run(batch):
            return fn(inputs.dev_tokens[:batch], inputs.dev_positions[:batch])
        rows.append({"system": "eager", "batch": b,
                     "step_ms": time_decode(run, inputs, b, a.context,
                                            a.warmup, a.reps)})
    return rows


def capture_graphs(fn, make_args, keys, device):
    """CUDA graphs of fn(*make_args(key)) per key, largest key first.

    The gpt-fast / torch.cuda.graphs recipe: a few warm-up calls per key on
    a side stream (cuBLAS handles, allocator state, lazy init), then one
    capture per key into a pool shared by all keys (a smaller graph reuses
    the larger one's memory). Returns ({key: (graph, static output)},
    seconds, free-bytes drop, reserved-bytes delta).
    """
    free0, res0 = memory_snapshot(device)
    t0 = time.perf_counter()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for key in keys:
            for _ in range(3):
                fn(*make_args(key))
    torch.cuda.current_stream(device).wait_stream(side)
    pool = torch.cuda.graph_pool_handle()
    graphs = {}
    for key in sorted(keys, reverse=True):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn(*make_args(key))
        graphs[key] = (graph, out)
    sync(device)
    seconds = time.perf_counter() - t0
    free1, res1 = memory_snapshot(device)
    return graphs, seconds, free0 - free1, res1 - res0


def bench_graph_decode(model, inputs, batches, a, device):
    fn = decode_step_fn(model)
    for b in batches:  # capture-time positions must be valid cache slots
        inputs.upload(b, a.context)
    graphs, seconds, mem, reserved = capture_graphs(
        fn, lambda b: (inputs.dev_tokens[:b], inputs.dev_positions[:b]),
        batches, device)
    rows = []
    for b in batches:
        graph, out = graphs[b]

        def run(batch, graph=graph, out=out):
            graph.replay()
            return out
        rows.append({"system": "cuda_graph", "batch": b,
                     "step_ms": time_decode(run, inputs, b, a.context,
                                            a.warmup, a.reps)})
    capture = {"system": "cuda_graph", "phase": "decode",
               "graphs": len(graphs), "seconds": seconds,
               "memory_bytes": mem, "reserved_bytes": reserved}
    del graphs
    return rows, capture


def configure_dynamo():
    """Room for one compiled graph per batch size / prompt length."""
    import torch._dynamo as dynamo
    for knob in ("cache_size_limit", "recompile_limit",
                 "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(dynamo.config, knob):
            setattr(dynamo.config, knob, max(256, getattr(dynamo.config,
                                                          knob)))


def mark_static(model):
    """Tell Dynamo the KV caches and RoPE tables keep their addresses, so
    the in-place KV writes do not make CUDA graph trees skip the graph."""
    import torch._dynamo as dynamo
    if hasattr(dynamo, "mark_static_address"):
        for t in model.static_tensors():
            dynamo.mark_static_address(t)


def cudagraph_skips():
    """Inductor's count of graphs it ran *without* CUDA graphs (e.g. on a
    mutated non-static input); None where this torch does not count."""
    try:
        from torch._dynamo.utils import counters
        return int(counters["inductor"]["cudagraph_skips"])
    except Exception:
        return None


def compile_note(skips_before):
    """The capture record's note: compile time included, graph skips."""
    after = cudagraph_skips()
    note = "seconds include Inductor compilation"
    if after is not None and skips_before is not None and after > \
            skips_before:
        note += "; %d graph(s) ran WITHOUT CUDA graphs (cudagraph_skips)" \
            % (after - skips_before)
    return note


def step_begin():
    mark = getattr(getattr(torch, "compiler", None),
                   "cudagraph_mark_step_begin", None)
    if mark is not None:
        mark()


def bench_compile_decode(model, inputs, batches, a, device):
    configure_dynamo()
    mark_static(model)
    compiled = torch.compile(decode_step_fn(model), mode="reduce-overhead")
    skips = cudagraph_skips()

    def run(batch):
        step_begin()
        return compiled(inputs.dev_tokens[:batch],
                        inputs.dev_positions[:batch])
    free0, res0 = memory_snapshot(device)
    t0 = time.perf_counter()
    for b in batches:  # compile + warm-up + record, per batch size
        inputs.upload(b, a.context)
        for _ in range(3):
            run(b).cpu()
    seconds = time.perf_counter() - t0
    free1, res1 = memory_snapshot(device)
    rows = [{"system": "compile", "batch": b,
             "step_ms": time_decode(run, inputs, b, a.context, a.warmup,
                                    a.reps)} for b in batches]
    capture = {"system": "compile", "phase": "decode", "graphs": len(batches),
               "seconds": seconds, "memory_bytes": free0 - free1,
               "reserved_bytes": res1 - res0, "note": compile_note(skips)}
    return rows, capture


# ----------------------------------------------------------------------------
# Systems: prefill


def time_prefill(run, prompt, length, warmup, reps):
    """Median ms of run(length) -> device token, incl. upload and .cpu()."""
    def step(_):
        prompt.upload(length)
        run(length).cpu()
    return median_ms(step, warmup, reps)


class PromptInput:
    """A pinned host prompt and its static device buffer [1, Lmax]."""

    def __init__(self, max_len, device, vocab):
        self.host = torch.randint(0, vocab, (1, max_len), dtype=torch.int64)
        if device.type == "cuda":
            self.host = self.host.pin_memory()
        self.dev = torch.zeros(1, max_len, dtype=torch.int64, device=device)

    def upload(self, length):
        self.dev[:, :length].copy_(self.host[:, :length], non_blocking=True)


def bench_prefill(system, model, prompt, lens, a, device):
    """Rows (+ a capture record for graph systems) for one system."""
    fn = prefill_fn(model)
    capture = None
    if system == "eager":
        def run(n):
            return fn(prompt.dev[:, :n])
    elif system == "cuda_graph":
        for n in lens:
            prompt.upload(n)
        graphs, seconds, mem, reserved = capture_graphs(
            fn, lambda n: (prompt.dev[:, :n],), lens, device)
        capture = {"system": "cuda_graph", "phase": "prefill",
                   "graphs": len(graphs), "seconds": seconds,
                   "memory_bytes": mem, "reserved_bytes": reserved}

        def run(n):
            graph, out = graphs[n]
            graph.replay()
            return out
    elif system == "compile":
        configure_dynamo()
        mark_static(model)
        compiled = torch.compile(fn, mode="reduce-overhead")
        skips = cudagraph_skips()
        free0, res0 = memory_snapshot(device)
        t0 = time.perf_counter()

        def run(n):
            step_begin()
            return compiled(prompt.dev[:, :n])
        for n in lens:
            prompt.upload(n)
            for _ in range(3):
                run(n).cpu()
        free1, res1 = memory_snapshot(device)
        capture = {"system": "compile", "phase": "prefill",
                   "graphs": len(lens),
                   "seconds": time.perf_counter() - t0,
                   "memory_bytes": free0 - free1,
                   "reserved_bytes": res1 - res0,
                   "note": compile_note(skips)}
    else:
        raise ValueError(system)
    rows = [{"system": system, "tokens": n,
             "ms": time_prefill(run, prompt, n, a.prefill_warmup,
                                a.prefill_reps)} for n in lens]
    return rows, capture


# ----------------------------------------------------------------------------
# transformers' own model


def bench_hf(a, device, vocab):
    """hf_eager decode rows (DynamicCache, context-token prefill first) and
    batch-1 prefill rows."""
    model = hf_util.load_causal_lm(a.model, torch.bfloat16 if a.dtype ==
                                   "bfloat16" else torch.float32, device)
    keep = hf_util.keep_logits_kwargs(model, 1)
    decode, prefill = [], []
    with torch.no_grad():
        for b in parse_list(a.hf_batches):
            ids = torch.randint(0, vocab, (b, a.context), device=device)
            out = model(input_ids=ids, use_cache=True, **keep)
            state = {"cache": out.past_key_values,
                     "next": out.logits[:, -1].argmax(-1).cpu()}
            del out

            def step(_, state=state):
                dev = state["next"].to(device, non_blocking=True)[:, None]
                out = model(input_ids=dev, past_key_values=state["cache"],
                            use_cache=True)
                state["cache"] = out.past_key_values
                state["next"] = out.logits[:, -1].argmax(-1).cpu()
            decode.append({"system": "hf_eager", "batch": b,
                           "step_ms": median_ms(step, a.warmup,
                                                min(a.reps, a.hf_reps))})
            del state
            if device.type == "cuda":
                torch.cuda.empty_cache()
        for n in parse_list(a.prefill_lens):
            ids = torch.randint(0, vocab, (1, n))
            if device.type == "cuda":
                ids = ids.pin_memory()

            def step(_, ids=ids):
                out = model(input_ids=ids.to(device, non_blocking=True),
                            use_cache=True, **keep)
                out.logits[:, -1].argmax(-1).cpu()
            prefill.append({"system": "hf_eager", "tokens": n,
                            "ms": median_ms(step, a.prefill_warmup,
                                            a.prefill_reps)})
    model = None  # free it before the caller goes on
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return decode, prefill


# ----------------------------------------------------------------------------
# Driver


def parse_list(text):
    return [int(x) for x in str(text).split(",") if x.strip()]


def round_up(n, m):
    return (n + m - 1) // m * m


def error_text(e):
    return ("%s: %s" % (type(e).__name__, e))[:2000]


def guarded(result, system, phase, fn):
    """Runs fn(); on an exception records it instead of crashing."""
    try:
        return fn()
    except Exception as e:  # a failing baseline must not hide the others
        result["errors"].append({"system": system, "phase": phase,
                                 "error": error_text(e)})
        print("torch_bench: %s %s failed: %s" % (system, phase,
                                                  error_text(e)),
              file=sys.stderr)
        return None


def hbm_rows(result, args_model, a):
    """Batch-1 (weight + KV bytes) / step time / peak, per system."""
    peak = result["peak_bytes_per_s"]
    total = result["weight_bytes"] + result["kv_bytes_batch1"]
    rows = []
    for r in result["decode"]:
        if r["batch"] != 1:
            continue
        bps = total / (r["step_ms"] / 1e3)
        rows.append({"system": r["system"], "bytes": total,
                     "bytes_per_s": bps,
                     "fraction": bps / peak if peak > 0 else None})
    return rows


def run(a):
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    systems = [s for s in a.systems.split(",") if s]
    for s in systems:
        if s not in ALL_SYSTEMS:
            raise SystemExit("unknown system %r (known: %s)" %
                             (s, ", ".join(ALL_SYSTEMS)))
    batches = parse_list(a.batches)
    lens = parse_list(a.prefill_lens)
    name = device_name(device)
    result = {"device": name, "torch": torch.__version__,
              "cuda": getattr(torch.version, "cuda", None),
              "model_dir": os.path.abspath(a.model), "context": a.context,
              "dtype": a.dtype, "reps": a.reps, "warmup": a.warmup,
              "prefill_reps": a.prefill_reps, "decode": [], "prefill": [],
              "capture": [], "errors": [], "skipped": [], "notes": [
                  "decode step = host->device input copy + forward + argmax "
                  "+ .cpu() of the sampled tokens; median wall time",
                  "prefill = batch-1 prompt from an empty cache, last-"
                  "position logits, argmax, .cpu()"]}
    if device.type == "cpu":
        for s in ("cuda_graph", "compile"):
            if s in systems:
                systems.remove(s)
                result["skipped"].append({"system": s,
                                          "reason": "--device cpu"})
    if device.type == "cuda":
        # The fp32 path must not silently become TF32.
        torch.backends.cuda.matmul.allow_tf32 = False
    model = torch_llama.load(a.model, dtype=dtype, device=device)
    args = model.args
    result["config"] = {"hidden": args.hidden, "layers": args.layers,
                        "heads": args.heads, "kv_heads": args.kv_heads,
                        "head_dim": args.head_dim,
                        "intermediate": args.intermediate,
                        "vocab": args.vocab, "tied": args.tied,
                        "attention": model.attention}
    element = torch.tensor([], dtype=dtype).element_size()
    result["weight_bytes"] = torch_llama.decode_weight_bytes(args, element)
    mean_pos = a.context + a.warmup + a.reps / 2.0
    result["kv_bytes_batch1"] = (torch_llama.kv_bytes_per_token(args, element)
                                 * mean_pos)
    result["peak_bytes_per_s"] = peak_bytes_per_s(name, a.peak_tbps)
    compile_scope = [s for s in a.compile_scope.split(",") if s]

    # Decode: cache rows for the largest batch, ~context + steps long.
    steps = max(a.warmup, 3) + a.reps + 4
    model.setup_cache(max(batches), round_up(a.context + steps + 1, 64))
    inputs = HostInputs(max(batches), device, args.vocab)
    with torch.no_grad():
        if "eager" in systems:
            rows = guarded(result, "eager", "decode",
                           lambda: bench_eager_decode(model, inputs, batches,
                                                      a))
            result["decode"] += rows or []
        if "cuda_graph" in systems:
            out = guarded(result, "cuda_graph", "decode",
                          lambda: bench_graph_decode(model, inputs, batches,
                                                     a, device))
            if out:
                result["decode"] += out[0]
                result["capture"].append(out[1])
        if "compile" in systems and "decode" in compile_scope:
            out = guarded(result, "compile", "decode",
                          lambda: bench_compile_decode(model, inputs, batches,
                                                       a, device))
            if out:
                result["decode"] += out[0]
                result["capture"].append(out[1])
        elif "compile" in systems:
            result["skipped"].append({"system": "compile", "phase": "decode",
                                      "reason": "--compile_scope"})

        # Prefill: a batch-1 cache as long as the longest prompt.
        if lens:
            model.setup_cache(1, round_up(max(lens), 64))
            prompt = PromptInput(max(lens), device, args.vocab)
            for s in ("eager", "cuda_graph", "compile"):
                if s not in systems:
                    continue
                if s == "compile" and "prefill" not in compile_scope:
                    result["skipped"].append({
                        "system": "compile", "phase": "prefill",
                        "reason": "--compile_scope"})
                    continue
                out = guarded(result, s, "prefill", lambda s=s: bench_prefill(
                    s, model, prompt, lens, a, device))
                if out:
                    result["prefill"] += out[0]
                    if out[1]:
                        result["capture"].append(out[1])
    model = None  # free our copy of the weights before loading HF's
    if device.type == "cuda":
        torch.cuda.empty_cache()

    if "hf_eager" in systems:
        try:
            hf_util.import_transformers()
        except hf_util.HFUnavailable as e:
            result["skipped"].append({"system": "hf_eager",
                                      "reason": str(e)})
        else:
            out = guarded(result, "hf_eager", "decode+prefill",
                          lambda: bench_hf(a, device, args.vocab))
            if out:
                result["decode"] += out[0]
                result["prefill"] += out[1]
    result["hbm_batch1"] = hbm_rows(result, args, a)
    return result


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--out", required=True, help="JSON output file")
    p.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--prefill_lens", default="64,128,256,512,1024,2048")
    p.add_argument("--context", type=int, default=512,
                   help="tokens already in each sequence's cache")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--prefill_reps", type=int, default=5)
    p.add_argument("--prefill_warmup", type=int, default=2)
    p.add_argument("--hf_batches", default="1,8,64,256")
    p.add_argument("--hf_reps", type=int, default=10)
    p.add_argument("--systems", default=",".join(ALL_SYSTEMS))
    p.add_argument("--compile_scope", default="decode,prefill",
                   help="which phases torch.compile runs: decode,prefill")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16",
                   choices=["bfloat16", "float32"])
    p.add_argument("--peak_tbps", type=float, default=0.0,
                   help="HBM peak in TB/s; 0: from the device name")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("torch_bench: no CUDA device (use --device cpu)")
    result = run(a)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    for r in result["decode"]:
        print("decode  %-10s B=%-4d %8.3f ms" % (r["system"], r["batch"],
                                                 r["step_ms"]))
    for r in result["prefill"]:
        print("prefill %-10s L=%-5d %8.3f ms" % (r["system"], r["tokens"],
                                                 r["ms"]))
    for c in result["capture"]:
        print("capture %-10s %-7s %d graphs %.2f s %.1f MiB" % (
            c["system"], c["phase"], c["graphs"], c["seconds"],
            c["memory_bytes"] / 2 ** 20))
    for e in result["errors"]:
        print("ERROR   %s %s: %s" % (e["system"], e["phase"], e["error"]))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
