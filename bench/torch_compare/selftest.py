#!/usr/bin/env python3
"""CPU self-test of bench/torch_compare (no GPU, no transformers needed).

  /usr/bin/python3 bench/torch_compare/selftest.py [--keep DIR]

Why: the GPU machine runs these scripts once, unattended; everything that
can be checked without it is checked here first.
  1. torch_llama vs tests/reference/llama_reference.py (float64 numpy, an
     independent implementation of HF Llama semantics): fp32 logits of
     whole prompts (every position) and of a prefill followed by 8 decode
     steps on the static KV cache, on two tiny checkpoints written by
     make_checkpoint.py --backend builtin (tiny: untied, 2:1 GQA, llama3
     RoPE scaling; tiny_tied: tied, 4:1 GQA, plain RoPE). Must agree to
     REF_TOL (fp32 rounding), prompts of 1, 7, 64 and 300 tokens.
  2. Batched decode with rows at different positions (what the benchmark's
     static cache sees) vs the reference, and bf16 vs fp32 sanity.
  3. config.json layouts: transformers 5 (rope_parameters only), < 5
     (rope_theta / rope_scaling) and both give the same RoPE; disagreeing
     layouts are refused.
  4. hf_compare's numpy checks on synthetic logits (pass, near tie,
     mismatch); its probe bookkeeping end to end with torch_llama standing
     in for both pdworker and transformers (a correct probe passes, one
     whose decode logits are shifted by a step fails); make_prompts
     determinism.
  5. torch_bench.py --device cpu on the tiny checkpoint, then report.py on
     its JSON plus a synthetic pdworker JSON (tables and the four targets).
Exit status 0 if everything passes, 1 otherwise (each failure printed).
"""

import argparse
import contextlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import configs  # noqa: E402
import hf_compare  # noqa: E402
import make_checkpoint  # noqa: E402
import make_prompts  # noqa: E402
import report  # noqa: E402
import torch_bench  # noqa: E402
import torch_llama  # noqa: E402

REFERENCE = os.path.join(ROOT, "tests", "reference", "llama_reference.py")
REF_TOL = 5e-5  # max |fp32 torch - float64 reference| on logits up to ~30
PROMPT_LENS = (1, 7, 64, 300)
DECODE_STEPS = 8

FAILURES = []


def check(cond, what):
    print("%s %s" % ("ok  " if cond else "FAIL", what))
    if not cond:
        FAILURES.append(what)


# ----------------------------------------------------------------------------
# Reference


def reference_logits(model_dir, sequences, work):
    """[np.float32 [n_i, V]] from llama_reference.py --out, one per seq."""
    out = os.path.join(work, "ref.bin")
    text = ";".join(",".join(str(t) for t in s) for s in sequences)
    subprocess.run([sys.executable, REFERENCE, "--model", model_dir,
                    "--tokens", text, "--out", out], check=True)
    result = []
    with open(out, "rb") as f:
        for _ in sequences:
            n, v = struct.unpack("<ii", f.read(8))
            result.append(np.frombuffer(f.read(4 * n * v),
                                        dtype="<f4").reshape(n, v))
    return result


def prompts_for(vocab):
    return make_prompts.make_prompts(vocab, PROMPT_LENS, seed=1)


# ----------------------------------------------------------------------------
# 1 + 2: torch_llama numerics


def greedy_path(model, prompt, steps):
    """Prefill + `steps` decode steps on cache row 0: (tokens, logits
    [steps + 1, V]) where logits row k predicts tokens[k]."""
    model.setup_cache(1, len(prompt) + steps + 1)
    rows = [model.prefill(torch.tensor([prompt]))[0]]
    tokens = []
    for i in range(steps):
        tokens.append(int(rows[-1].argmax()))
        rows.append(model.decode_step(torch.tensor([tokens[-1]]),
                                      torch.tensor([len(prompt) + i]))[0])
    tokens.append(int(rows[-1].argmax()))
    return tokens, torch.stack(rows).float().numpy()


def test_numerics(model_dir, work):
    model = torch_llama.load(model_dir, dtype=torch.float32)
    vocab = model.args.vocab
    prompts = prompts_for(vocab)
    paths = [greedy_path(model, p, DECODE_STEPS) for p in prompts]
    sequences = [p + toks[:DECODE_STEPS] for p, (toks, _) in
                 zip(prompts, paths)]
    refs = reference_logits(model_dir, sequences, work)
    name = os.path.basename(model_dir)
    for prompt, (toks, rows), seq, ref in zip(prompts, paths, sequences,
                                              refs):
        t = len(prompt)
        # (a) prefill over the whole sequence, every position
        model.setup_cache(1, len(seq))
        full = model.prefill(torch.tensor([seq]), all_logits=True)[0].numpy()
        d_full = float(np.abs(full - ref).max())
        # (b) prefill + decode steps on the cache
        d_step = float(np.abs(rows - ref[t - 1:]).max())
        same = all(int(np.argmax(ref[t - 1 + k])) == toks[k]
                   for k in range(DECODE_STEPS + 1))
        scale = float(np.abs(ref).max())
        check(d_full <= REF_TOL and d_step <= REF_TOL and same,
              "%s prompt %d: all-position max diff %.2e, prefill+%d decode "
              "max diff %.2e (|logit| <= %.1f), greedy equal: %s" %
              (name, t, d_full, DECODE_STEPS, d_step, scale, same))
    test_batched_positions(model, prompts, refs, name)
    test_bf16(model_dir, prompts[2], name)


def test_batched_positions(model, prompts, refs, name):
    """Rows fed token by token, each at its own position: a row whose
    prompt has ended re-feeds its last token at its last position (an
    idempotent rewrite of the same cache slot), so rows sit at different
    positions in the same step."""
    seqs = [prompts[1], prompts[2], prompts[0]]  # lengths 7, 64, 1
    expect = [refs[1], refs[2], refs[0]]
    n = max(len(s) for s in seqs)
    model.setup_cache(len(seqs), n + 1)
    logits = None
    for step in range(n):
        pos = [min(step, len(s) - 1) for s in seqs]
        tok = [s[p] for s, p in zip(seqs, pos)]
        logits = model.decode_step(torch.tensor(tok), torch.tensor(pos))
    worst = max(float(np.abs(logits[i].numpy() - expect[i][len(s) - 1])
                      .max()) for i, s in enumerate(seqs))
    check(worst <= REF_TOL, "%s batched decode, rows at positions 6/63/0: "
          "max diff %.2e" % (name, worst))


def test_bf16(model_dir, prompt, name):
    m32 = torch_llama.load(model_dir, dtype=torch.float32)
    m16 = torch_llama.load(model_dir, dtype=torch.bfloat16)
    _, r32 = greedy_path(m32, prompt, 4)
    m16.setup_cache(1, len(prompt) + 1)
    r16 = m16.prefill(torch.tensor([prompt]))[0].float().numpy()
    d = float(np.abs(r16 - r32[0]).max())
    std = float(r32[0].std())
    check(d < 0.1 * max(std, 1.0), "%s bf16 prefill vs fp32: max diff "
          "%.3f (logit std %.2f)" % (name, d, std))


# ----------------------------------------------------------------------------
# 3: config layouts


def test_config_layouts(work):
    base = configs.config_json("tiny", "both")
    want = torch_llama.Args(base)
    for layout in ("legacy", "v5"):
        got = torch_llama.Args(configs.config_json("tiny", layout))
        check(got.rope_theta == want.rope_theta and
              torch_llama._same_scaling(got.rope_scaling, want.rope_scaling),
              "config layout %s: theta %g, scaling %s" %
              (layout, got.rope_theta, got.rope_scaling))
    bad = dict(base, rope_theta=10000.0)
    try:
        torch_llama.Args(bad)
        check(False, "disagreeing rope_theta refused")
    except torch_llama.ModelError:
        check(True, "disagreeing rope_theta refused")
    plain = configs.config_json("tiny_tied", "v5")
    check(torch_llama.Args(plain).rope_scaling is None,
          "v5 layout with rope_type default -> no scaling")
    inv = torch_llama.rope_inv_freq(want)
    plain_inv = 1.0 / (want.rope_theta ** (torch.arange(0, 16, 2).float()
                                           / 16))
    regimes = (int((inv == plain_inv).sum()),
               int((inv == plain_inv / 8).sum()))
    check(regimes[0] > 0 and regimes[1] > 0 and sum(regimes) < len(inv),
          "tiny llama3 RoPE covers kept/divided/smoothed frequencies: %s of "
          "%d kept/divided" % (regimes, len(inv)))


# ----------------------------------------------------------------------------
# 4: hf_compare checks, prompts


def test_hf_compare_checks():
    rng = np.random.default_rng(0)
    v = 1000
    hf32 = rng.normal(0, 4, (6, v)).astype(np.float32)
    hf16 = hf32 + rng.normal(0, 0.01, hf32.shape).astype(np.float32)
    good = hf32 + rng.normal(0, 0.01, hf32.shape).astype(np.float32)
    r = hf_compare.check_logits(good[:3], hf32[:3], hf16[:3])
    check(r["pass"], "check_logits passes bf16-sized noise (max %.3f, tol "
          "%.3f)" % (r["pdworker"]["max"], r["tol"]))
    bad = good.copy()
    bad[1, 7] += 1.0
    r = hf_compare.check_logits(bad[:3], hf32[:3], hf16[:3])
    check(not r["pass"], "check_logits fails a 1.0 logit error (max %.3f, "
          "tol %.3f)" % (r["pdworker"]["max"], r["tol"]))
    greedy = [int(np.argmax(row)) for row in hf32]
    check(hf_compare.check_greedy(greedy, hf32, hf16)["exact"] == 6,
          "check_greedy: identical argmax -> 6 exact")
    tie = hf32.copy()
    second = int(np.argsort(tie[2])[-2])
    tie[2, second] = tie[2, greedy[2]] - 0.01  # a near tie at step 2
    g2 = list(greedy)
    g2[2] = second
    r = hf_compare.check_greedy(g2, tie, tie + (hf16 - hf32))
    check(r["pass"] and r["near_ties"] == 1 and r["first_near_tie"] == 2,
          "check_greedy: near tie counted, not failed")
    g3 = list(greedy)
    g3[4] = int(np.argmin(hf32[4]))
    r = hf_compare.check_greedy(g3, hf32, hf16)
    check(not r["pass"] and r["mismatches"][0]["step"] == 4,
          "check_greedy: far-off token fails (gap %.1f)" %
          r["mismatches"][0]["gap"])
    check(hf_compare.common_prefix([1, 2, 3], [1, 2, 4]) == 2,
          "common_prefix")


class FakeHF:
    """Stands in for transformers' LlamaForCausalLM in hf_compare's code
    paths: forward(input_ids, use_cache, logits_to_keep) -> .logits, via
    torch_llama (whose HF semantics test_numerics establishes)."""

    class Out:
        def __init__(self, logits):
            self.logits = logits

    def __init__(self, model_dir, dtype):
        self.m = torch_llama.load(model_dir, dtype=dtype)

    def forward(self, input_ids, use_cache=False, logits_to_keep=0):
        self.m.setup_cache(1, input_ids.shape[1])
        logits = self.m.prefill(input_ids, all_logits=True)
        return self.Out(logits[:, -logits_to_keep:] if logits_to_keep
                        else logits)

    __call__ = forward


def write_probe(model_dir, prompts, out_dir, steps, k, mode):
    """What logits_probe writes, computed by torch_llama in fp32."""
    model = torch_llama.load(model_dir, dtype=torch.float32)
    os.makedirs(out_dir, exist_ok=True)
    entries, pre, dec = [], [], []
    for p in prompts:
        toks, rows = greedy_path(model, p, steps)
        entries.append({"prompt": p, "greedy": toks[:steps]})
        pre.append(rows[0])
        dec.append(rows[1:k + 1])
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump({"mode": mode, "device": "cpu", "vocab": model.args.vocab,
                   "greedy_steps": steps, "decode_logits_steps": k,
                   "prompts": entries}, f)
    np.save(os.path.join(out_dir, "prefill_logits.npy"),
            np.stack(pre).astype(np.float32))
    np.save(os.path.join(out_dir, "decode_logits.npy"),
            np.stack(dec).astype(np.float32))


def test_hf_compare_flow(model_dir, work):
    """hf_compare's row bookkeeping end to end, with torch_llama as both
    'pdworker' (fp32: must pass with ~0 diff) and 'HF' (fp32 and bf16),
    and a probe whose decode logits are shifted by one step (must fail)."""
    vocab = torch_llama.load_args(model_dir).vocab
    prompts = make_prompts.make_prompts(vocab, [1, 7, 40], seed=3)
    good = os.path.join(work, "probe_good")
    write_probe(model_dir, prompts, good, 12, 4, "FULL")
    fp32 = FakeHF(model_dir, torch.float32)
    bf16 = FakeHF(model_dir, torch.bfloat16)

    def generate(model, prompt, n, device):
        toks, _ = greedy_path(model.m, prompt, n)
        return toks[:n]
    r = hf_compare.compare_probe(hf_compare.load_probe(good), bf16, fp32,
                                 "cpu", {}, generate)
    worst = max(p["logits"]["pdworker"]["max"] for p in r["prompts"])
    check(r["pass"] and worst < 1e-4 and all(
        p["greedy"]["exact"] == 12 for p in r["prompts"]),
          "hf_compare flow, identical fp32 'pdworker': pass, max diff "
          "%.1e, HF bf16 floor max %.3f, bf16 generate prefixes %s" % (
              worst, max(p["logits"]["hf_bf16"]["max"]
                         for p in r["prompts"]),
              [p["generate_bf16_prefix"] for p in r["prompts"]]))
    shifted = os.path.join(work, "probe_shifted")
    shutil.copytree(good, shifted)
    dec = np.load(os.path.join(shifted, "decode_logits.npy"))
    pre = np.load(os.path.join(shifted, "prefill_logits.npy"))
    np.save(os.path.join(shifted, "decode_logits.npy"),
            np.concatenate([pre[:, None], dec[:, :-1]], axis=1))
    r = hf_compare.compare_probe(hf_compare.load_probe(shifted), bf16, fp32,
                                 "cpu", {}, generate)
    check(not r["pass"], "hf_compare flow, decode logits off by one step: "
          "fails (max diff %.2f)" % max(p["logits"]["pdworker"]["max"]
                                        for p in r["prompts"]))
    md = hf_compare.markdown({"model_dir": model_dir, "modes": [r],
                              "errors": []})
    check("FAIL" in md and "| 40 |" in md, "hf_compare markdown renders")


def test_prompts(work):
    a = make_prompts.make_prompts(128256, [1, 7, 64, 300, 1000], 0)
    b = make_prompts.make_prompts(128256, [1, 7, 64, 300, 1000], 0)
    path = os.path.join(work, "prompts.json")
    make_prompts.main(["--vocab", "128256", "--out", path])
    with open(path) as f:
        c = json.load(f)["prompts"]
    check(a == b == c and [len(p) for p in a] == [1, 7, 64, 300, 1000] and
          all(0 <= t < 128256 for p in a for t in p),
          "make_prompts: deterministic, lengths 1/7/64/300/1000, in range")


# ----------------------------------------------------------------------------
# 5: torch_bench on the CPU, report.py


def synthetic_pdworker(torch_json, full_ms, none_ms, capture_s, capture_mib):
    """A gpu_decode_bench-style JSON whose numbers are chosen per test."""
    batches = sorted({r["batch"] for r in torch_json["decode"]})
    lens = sorted({r["tokens"] for r in torch_json["prefill"]})
    decode = []
    for b in batches:
        decode.append({"mode": "NONE", "batch": b, "step_ms": none_ms,
                       "ran_as": "NONE"})
        decode.append({"mode": "PIECEWISE", "batch": b, "step_ms":
                       (none_ms + full_ms) / 2, "ran_as": "PIECEWISE"})
        decode.append({"mode": "FULL", "batch": b, "step_ms": full_ms,
                       "ran_as": "FULL"})
    return {"device": "synthetic", "model_dir": torch_json["model_dir"],
            "context": torch_json["context"], "decode": decode,
            "prefill": [{"mode": m, "tokens": n, "step_ms": 1.0,
                         "ran_as": m} for m in ("NONE", "FULL")
                        for n in lens],
            "capture": [{"mode": "FULL", "graphs": 9, "seconds": capture_s,
                         "memory_bytes": capture_mib * 2 ** 20},
                        {"mode": "PIECEWISE", "graphs": 20, "seconds": 1.0,
                         "memory_bytes": 2 ** 20}],
            "weight_bytes": torch_json["weight_bytes"],
            "kv_bytes_batch1": torch_json["kv_bytes_batch1"],
            "peak_bytes_per_s": 1e9}


def run_report(argv):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        report.main(argv)
    return buf.getvalue()


def test_bench_and_report(model_dir, work):
    out = os.path.join(work, "torch.json")
    rc = torch_bench.main(["--model", model_dir, "--out", out, "--device",
                           "cpu", "--dtype", "float32", "--batches", "1,2,4",
                           "--prefill_lens", "8,32", "--context", "16",
                           "--reps", "3", "--prefill_reps", "2"])
    with open(out) as f:
        t = json.load(f)
    systems = {s["system"] for s in t["skipped"]}
    check(rc == 0 and len(t["decode"]) == 3 and len(t["prefill"]) == 2 and
          {"cuda_graph", "compile"} <= systems,
          "torch_bench --device cpu: 3 decode rows (%s ms), 2 prefill rows, "
          "graph systems skipped" % ", ".join(
              "%.3f" % r["step_ms"] for r in t["decode"]))
    # Pretend the torch rows came from CUDA graphs, then make pdworker
    # faster (targets met) and slower (not met).
    eager1 = next(r["step_ms"] for r in t["decode"] if r["batch"] == 1)
    t["decode"] += [dict(r, system="cuda_graph") for r in t["decode"]]
    t["peak_bytes_per_s"] = 1e9
    with open(out, "w") as f:
        json.dump(t, f)
    total = t["weight_bytes"] + t["kv_bytes_batch1"]
    fast_ms = total / 0.9e9 * 1e3  # 90% of a 1 GB/s "peak"
    for label, full, none, cap_s, cap_mib, want in (
            ("met", min(fast_ms, eager1 / 2), 2 * min(fast_ms, eager1 / 2),
             0.5, 10, "met"),
            ("not met", eager1 * 2, eager1 * 2.2, 3.0, 100, "not met")):
        pd_path = os.path.join(work, "pd_%s.json" % label.replace(" ", "_"))
        with open(pd_path, "w") as f:
            json.dump(synthetic_pdworker(t, full, none, cap_s, cap_mib), f)
        md = run_report(["--torch", out, "--pdworker", pd_path, "--shape",
                         "llama_1b"])
        rows = [l for l in md.splitlines() if l.startswith("| FULL") or
                l.startswith("| pdworker faster") or
                l.startswith("| all decode")]
        statuses = [l.split("|")[3].strip() for l in rows]
        if label == "met":
            # targets 1, 3 and 4 met; target 2 (for llama_0p5b) is
            # informational on llama_1b but met by construction (2x).
            ok = (statuses[0] == "met" and statuses[2] == "met" and
                  statuses[3] == "met" and "informational" in statuses[1])
        else:
            ok = (statuses[0] == "not met" and statuses[2] == "not met" and
                  statuses[3] == "not met")
        check(ok and "### Decode step" in md and "### Prefill" in md and
              "### Graph capture" in md,
              "report.py, pdworker targets %s: %s" % (want, statuses))
    md = run_report(["--torch", out, "--pdworker",
                     os.path.join(work, "absent.json")])
    check("missing input" in md and "### Decode step" in md,
          "report.py with a missing pdworker JSON still renders")


# ----------------------------------------------------------------------------


def build(work, shape):
    d = os.path.join(work, shape)
    make_checkpoint.main(["--shape", shape, "--out", d, "--backend",
                          "builtin", "--dtype", "float32"])
    return d


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keep", help="work directory to keep (default: temp)")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    work = a.keep or tempfile.mkdtemp(prefix="torch_compare_selftest_")
    os.makedirs(work, exist_ok=True)
    try:
        tiny = build(work, "tiny")
        tied = build(work, "tiny_tied")
        if os.path.exists(REFERENCE):
            test_numerics(tiny, work)
            test_numerics(tied, work)
        else:
            check(False, "reference %s exists" % REFERENCE)
        test_config_layouts(work)
        test_hf_compare_checks()
        test_hf_compare_flow(tiny, work)
        test_prompts(work)
        test_bench_and_report(tiny, work)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("\nselftest: %d failure(s)" % len(FAILURES))
    for f in FAILURES:
        print("  FAIL " + f)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
