#!/usr/bin/env python3
"""pdworker's logits and greedy tokens vs transformers' own forward (issue 10).

  hf_compare.py --model DIR --pdworker_out PROBE_DIR [--pdworker_out ...]
      [--out compare.json] [--device cuda]

Inputs: the checkpoint DIR and one or more logits_probe output directories
(result.json, prefill_logits.npy [P, V], decode_logits.npy [P, K, V]; one
per graph mode). transformers' LlamaForCausalLM is loaded twice from DIR:
in bf16 (what users run; SDPA attention) and in fp32 from the same bf16
weights (upcast exactly; eager attention, TF32 off): the "truth" up to fp32
rounding. For each probe and prompt p, with T = len(prompt) and greedy =
pdworker's N greedy tokens, one teacher-forced forward of each HF model over
prompt + greedy[:N-1] gives the logits that predict greedy[0..N-1] (rows
0..N-1); pdworker's prefill logits are row 0, its decode logits k are row
k + 1.

(a) Logits. For rows 0..K: max and mean |pdworker - HF fp32| and, as the
    noise floor, max and mean |HF bf16 - HF fp32| on the same rows.
    Pass if  pdworker max <= 2 * (HF bf16 max) + 0.02.
    Why: the difference between a correct bf16 implementation and the fp32
    truth is rounding, whose size the HF bf16 run measures on the very same
    rows (it grows with the logits' magnitude, the depth and the prompt
    length, so a fixed threshold would be too loose on small logits and
    too tight on long prompts). pdworker rounds at other places than HF
    (fused kernels, other GEMM tiling and accumulation order, bf16 KV cache
    written once), which can be up to about twice as far off; the 0.02
    absolute term covers rows where HF bf16 happens to land very close
    (the floor is a max over one prompt's few rows, a noisy statistic).
    A real bug (wrong RoPE, mask, norm, GQA mapping) moves logits by O(1),
    tens of times the floor. Means are reported, not gated.
(b) Greedy. At each of the N steps the HF fp32 argmax over row k is compared
    with pdworker's greedy[k]. Equal: exact. Different: the HF fp32 gap
    logit[argmax] - logit[greedy[k]] is at most 2 * tol_k -- a near tie,
    counted -- where tol_k is (a)'s rule on row k alone (2 * max|HF bf16 -
    HF fp32| over row k + 0.02; pdworker's own logits exist only for the
    first K rows): when each logit may be off by tol_k the two can swap
    order by up to 2 * tol_k. A larger gap is a mismatch and fails. This
    bound is conservative (a max over the whole vocabulary, for two
    particular tokens), so on random weights a good share of the steps
    where the paths differ are near ties; a real bug still fails, because
    it moves every step and many of its gaps are several logit units. (a)
    is the precise test.
    Teacher forcing keeps HF on pdworker's path, so the check stays valid
    after a near tie and all N steps are checked (rather than stopping at
    the first divergence); the first near-tie step is reported too.
(c) generate. HF bf16 model.generate (greedy, N new tokens, attention mask
    given, no EOS) per prompt; reported is the length of the prefix on
    which it equals pdworker's greedy tokens. Informational: two bf16
    implementations legitimately part ways at a near tie.

Prints a Markdown summary; writes JSON with --out; exit status 1 if any
probe fails (a) or (b), 2 on bad inputs.
"""

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

ABS_TOL = 0.02
FLOOR_FACTOR = 2.0


class InputError(Exception):
    """A probe directory that does not match the interface."""


# ----------------------------------------------------------------------------
# Inputs


def load_probe(path):
    """{"result": result.json, "prefill": [P, V], "decode": [P, K, V]}."""
    with open(os.path.join(path, "result.json")) as f:
        result = json.load(f)
    prefill = np.load(os.path.join(path, "prefill_logits.npy"))
    decode = np.load(os.path.join(path, "decode_logits.npy"))
    prompts = result.get("prompts") or []
    p, v = len(prompts), int(result["vocab"])
    k = int(result.get("decode_logits_steps", decode.shape[1]
                       if decode.ndim == 3 else 0))
    if prefill.shape != (p, v):
        raise InputError("%s: prefill_logits %s, expected %s" %
                         (path, prefill.shape, (p, v)))
    if decode.shape != (p, k, v):
        raise InputError("%s: decode_logits %s, expected %s" %
                         (path, decode.shape, (p, k, v)))
    for i, entry in enumerate(prompts):
        if not entry["prompt"] or not entry["greedy"]:
            raise InputError("%s: prompt %d has no tokens or no greedy" %
                             (path, i))
        if len(entry["greedy"]) < k + 1:
            raise InputError("%s: prompt %d: %d greedy tokens < K + 1" %
                             (path, i, len(entry["greedy"])))
        if any(not 0 <= t < v for t in entry["prompt"] + entry["greedy"]):
            raise InputError("%s: prompt %d has ids outside [0, %d)" %
                             (path, i, v))
    return {"result": result, "prefill": prefill.astype(np.float32),
            "decode": decode.astype(np.float32), "dir": path}


# ----------------------------------------------------------------------------
# The checks (numpy only; selftest.py exercises them without transformers)


def diff_stats(a, b):
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return {"max": float(d.max()), "mean": float(d.mean())}


def check_logits(pd_rows, hf32_rows, hf16_rows):
    """pd_rows [K+1, V] vs the same rows of HF fp32, floor = HF bf16."""
    pd = diff_stats(pd_rows, hf32_rows)
    floor = diff_stats(hf16_rows, hf32_rows)
    tol = FLOOR_FACTOR * floor["max"] + ABS_TOL
    return {"pdworker": pd, "hf_bf16": floor, "tol": tol,
            "pass": bool(pd["max"] <= tol)}


def row_tol(hf32_row, hf16_row):
    """Logit tolerance of one row: FLOOR_FACTOR * max|bf16 - fp32| + ABS."""
    floor = float(np.max(np.abs(hf16_row.astype(np.float64) -
                                hf32_row.astype(np.float64))))
    return FLOOR_FACTOR * floor + ABS_TOL


def check_greedy(greedy, hf32_rows, hf16_rows):
    """greedy [N] vs argmax of hf32_rows [N, V] (row k predicts greedy[k]).

    A step where HF fp32 prefers another token is a near tie if the fp32
    gap is at most 2 * row_tol (each of the two logits may be off by tol);
    otherwise a mismatch.
    """
    exact, near, mismatches, first_near = 0, 0, [], None
    max_gap_allowed = 0.0
    for k, token in enumerate(greedy):
        row = hf32_rows[k]
        best = int(np.argmax(row))
        if best == token:
            exact += 1
            continue
        gap = float(row[best]) - float(row[token])
        allowed = 2 * row_tol(row, hf16_rows[k])
        max_gap_allowed = max(max_gap_allowed, allowed)
        if gap <= allowed:
            near += 1
            if first_near is None:
                first_near = k
        else:
            mismatches.append({"step": k, "pdworker": int(token),
                               "hf_fp32": best, "gap": gap,
                               "allowed": allowed})
    prefix = next((k for k, t in enumerate(greedy)
                   if int(np.argmax(hf32_rows[k])) != t), len(greedy))
    return {"steps": len(greedy), "exact": exact, "near_ties": near,
            "first_near_tie": first_near, "exact_prefix": prefix,
            "max_gap_allowed": max_gap_allowed,
            "mismatches": mismatches, "pass": not mismatches}


def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ----------------------------------------------------------------------------
# transformers


def hf_rows(model, prompt, greedy, device):
    """float32 [N, V]: the logits predicting greedy[0..N-1], one forward."""
    import torch
    import hf_util
    n = len(greedy)
    seq = list(prompt) + list(greedy[:n - 1])
    ids = torch.tensor([seq], dtype=torch.long, device=device)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False,
                    **hf_util.keep_logits_kwargs(model, n))
    logits = out.logits[0, -n:].float().cpu().numpy()
    return logits


def hf_generate(model, prompt, n, device):
    """HF greedy continuation of n tokens (list of ints)."""
    import torch
    import hf_util
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask,
                             generation_config=hf_util
                             .greedy_generation_config(n))
    return [int(t) for t in out[0, ids.shape[1]:].tolist()]


def load_models(model_dir, device):
    """(bf16 model, fp32 model) with TF32 off for the fp32 one."""
    import torch
    import hf_util
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if hasattr(torch, "set_float32_matmul_precision"):
        torch.set_float32_matmul_precision("highest")
    bf16 = hf_util.load_causal_lm(model_dir, torch.bfloat16, device)
    fp32 = hf_util.load_causal_lm(model_dir, torch.float32, device,
                                  attn_implementation="eager")
    return bf16, fp32


def compare_probe(probe, bf16, fp32, device, generated, generate=None):
    """All checks for one probe; `generated` caches HF generate per prompt.

    generate(model, prompt, n, device) defaults to hf_generate (the
    self-test substitutes its own, with no transformers installed).
    """
    generate = generate or hf_generate
    k = probe["decode"].shape[1]
    prompts = []
    for i, entry in enumerate(probe["result"]["prompts"]):
        prompt, greedy = entry["prompt"], entry["greedy"]
        r32 = hf_rows(fp32, prompt, greedy, device)
        r16 = hf_rows(bf16, prompt, greedy, device)
        pd_rows = np.concatenate([probe["prefill"][i:i + 1],
                                  probe["decode"][i]], axis=0)
        logits = check_logits(pd_rows, r32[:k + 1], r16[:k + 1])
        greedy_check = check_greedy(greedy, r32, r16)
        key = (tuple(prompt), len(greedy))
        if key not in generated:
            generated[key] = generate(bf16, prompt, len(greedy), device)
        gen = generated[key]
        prompts.append({"index": i, "length": len(prompt), "logits": logits,
                        "greedy": greedy_check,
                        "generate_bf16_prefix": common_prefix(gen, greedy),
                        "generate_bf16_tokens": len(gen)})
    ok = all(p["logits"]["pass"] and p["greedy"]["pass"] for p in prompts)
    return {"mode": probe["result"].get("mode"),
            "ran_as": probe["result"].get("ran_as"),
            "device": probe["result"].get("device"),
            "probe_dir": os.path.abspath(probe["dir"]),
            "decode_logits_steps": k, "prompts": prompts, "pass": ok}


# ----------------------------------------------------------------------------
# Output


def markdown(report):
    """The human summary: one table per probe."""
    lines = ["## pdworker vs transformers (%s)" % report["model_dir"], "",
             "Tolerance: pdworker max |logit diff| vs HF fp32 <= "
             "%g x (HF bf16 vs HF fp32 max) + %g, per prompt; a greedy step "
             "where HF fp32 prefers another token must have an fp32 gap "
             "within 2 x that rule applied to its own row (a near tie)." %
             (FLOOR_FACTOR, ABS_TOL), ""]
    for m in report["modes"]:
        lines += ["### mode %s: %s" % (m["mode"], "PASS" if m["pass"]
                                       else "FAIL"), "",
                  "| prompt len | pdworker max / mean | HF bf16 max / mean | "
                  "tol | logits | greedy exact / near ties / mismatches | "
                  "first near tie | HF bf16 generate prefix |",
                  "| ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
        for p in m["prompts"]:
            lg, gr = p["logits"], p["greedy"]
            lines.append(
                "| %d | %.4f / %.5f | %.4f / %.5f | %.4f | %s | %d / %d / %d "
                "| %s | %d / %d |" % (
                    p["length"], lg["pdworker"]["max"],
                    lg["pdworker"]["mean"], lg["hf_bf16"]["max"],
                    lg["hf_bf16"]["mean"], lg["tol"],
                    "pass" if lg["pass"] else "FAIL", gr["exact"],
                    gr["near_ties"], len(gr["mismatches"]),
                    "-" if gr["first_near_tie"] is None else
                    gr["first_near_tie"], p["generate_bf16_prefix"],
                    gr["steps"]))
        for p in m["prompts"]:
            for mm in p["greedy"]["mismatches"][:3]:
                lines.append("- prompt len %d step %d: pdworker %d, HF fp32 "
                             "%d, gap %.4f" % (p["length"], mm["step"],
                                               mm["pdworker"], mm["hf_fp32"],
                                               mm["gap"]))
        lines.append("")
    for e in report.get("errors", []):
        lines.append("- ERROR: %s" % e)
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--pdworker_out", required=True, action="append",
                   help="logits_probe output directory (repeatable)")
    p.add_argument("--out", help="JSON report")
    p.add_argument("--device", default=None,
                   help="default: cuda if available, else cpu")
    a = p.parse_args(argv)
    report = {"model_dir": os.path.abspath(a.model), "modes": [],
              "errors": [], "tolerance": {
                  "rule": "pdworker_max <= factor * hf_bf16_max + abs",
                  "factor": FLOOR_FACTOR, "abs": ABS_TOL,
                  "greedy_gap": "2 * (factor * row max|hf_bf16 - hf_fp32|"
                                " + abs)"}}
    probes = []
    for d in a.pdworker_out:
        try:
            probes.append(load_probe(d))
        except (OSError, KeyError, ValueError, InputError) as e:
            report["errors"].append("%s: %s: %s" % (d, type(e).__name__, e))
    if not probes:
        print(markdown(report))
        _write(a.out, report)
        return 2
    import torch
    import hf_util
    try:
        transformers = hf_util.import_transformers()
    except hf_util.HFUnavailable as e:
        raise SystemExit("hf_compare: %s" % e)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    report.update({"transformers": transformers.__version__,
                   "torch": torch.__version__, "device": device})
    bf16, fp32 = load_models(a.model, device)
    vocab = int(fp32.config.vocab_size)
    generated = {}
    for probe in probes:
        if int(probe["result"]["vocab"]) != vocab:
            report["errors"].append("%s: vocab %s != model's %d" % (
                probe["dir"], probe["result"]["vocab"], vocab))
            continue
        report["modes"].append(compare_probe(probe, bf16, fp32, device,
                                             generated))
    report["pass"] = (not report["errors"] and
                      all(m["pass"] for m in report["modes"]))
    print(markdown(report))
    _write(a.out, report)
    return 0 if report["pass"] else 1


def _write(path, report):
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
