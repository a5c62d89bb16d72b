#!/usr/bin/env python3
"""Merges the PyTorch and pdworker benchmark JSONs into Markdown tables.

  report.py --torch torch.json --pdworker pdworker.json
      [--compare compare.json ...] [--shape llama_1b] > table.md

Tables: decode step time per batch size for every system and the ratios
pdworker FULL vs torch cuda_graph, vs torch compile, and FULL vs NONE
(> 1: FULL is faster); batch-1 prefill time per prompt length; capture time
and graph memory per system; batch-1 fraction of HBM bandwidth; the
correctness summary from hf_compare.py; and issue 10's four targets, each
met / not met with its numbers:
  1. FULL decode at batch 1 >= 80% of the HBM roofline (stated for llama_1b)
  2. FULL >= 1.5x NONE at batch 1 (stated for llama_0p5b)
  3. pdworker FULL faster than PyTorch with CUDA graphs at every batch <= 64
     (compared with the faster of torch's cuda_graph and compile rows)
  4. all decode graphs (pdworker FULL) captured in < 2 s using < 64 MiB
A target stated for the other shape is still evaluated, marked as such.
Missing or unreadable inputs are reported in the output, not fatal, so a
partial run still produces a table. Python standard library only.
"""

import argparse
import json
import os
import sys

TORCH_SYSTEMS = ("eager", "cuda_graph", "compile", "hf_eager")
PD_MODES = ("NONE", "PIECEWISE", "FULL")
MIB = 2.0 ** 20


def load(path, problems):
    if not path:
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        problems.append("%s: %s" % (path, e))
        return None


def fmt(x, spec="%.3f"):
    return "—" if x is None else spec % x


def ratio(num, den):
    if num is None or den is None or den <= 0:
        return None
    return num / den


# ----------------------------------------------------------------------------
# Indexing the inputs


def torch_decode(t):
    """{(system, batch): ms}"""
    return {(r["system"], r["batch"]): r["step_ms"]
            for r in (t or {}).get("decode", [])}


def torch_prefill(t):
    return {(r["system"], r["tokens"]): r["ms"]
            for r in (t or {}).get("prefill", [])}


def pd_decode(p):
    """{(mode, batch): (ms, ran_as)}"""
    return {(r["mode"], r["batch"]): (r["step_ms"], r.get("ran_as"))
            for r in (p or {}).get("decode", [])}


def pd_prefill(p):
    return {(r["mode"], r["tokens"]): (r["step_ms"], r.get("ran_as"))
            for r in (p or {}).get("prefill", [])}


def pd_ms(table, mode, key):
    v = table.get((mode, key))
    return v[0] if v else None


def pd_cell(table, mode, key):
    v = table.get((mode, key))
    if not v:
        return "—"
    ran = v[1]
    note = "" if not ran or ran == mode else " (ran %s)" % ran
    return "%.3f%s" % (v[0], note)


def best_torch_graph(td, batch):
    """Faster of torch's cuda_graph and compile rows (None if neither)."""
    vals = [(td[(s, batch)], s) for s in ("cuda_graph", "compile")
            if (s, batch) in td]
    return min(vals) if vals else None


def guess_shape(t, p):
    cfg = (t or {}).get("config") or {}
    if cfg.get("hidden") == 2048 and cfg.get("layers") == 16:
        return "llama_1b"
    if cfg.get("hidden") == 896 and cfg.get("layers") == 24:
        return "llama_0p5b"
    d = (t or {}).get("model_dir") or (p or {}).get("model_dir") or "?"
    return os.path.basename(os.path.normpath(d))


# ----------------------------------------------------------------------------
# Tables


def decode_table(t, p):
    td, pdd = torch_decode(t), pd_decode(p)
    batches = sorted({b for _, b in td} | {b for _, b in pdd})
    lines = ["### Decode step (ms; input copy + forward + argmax + tokens "
             "to host)", "",
             "| batch | torch eager | torch cuda_graph | torch compile | "
             "HF eager | pdworker NONE | pdworker PIECEWISE | pdworker FULL "
             "| cuda_graph / FULL | compile / FULL | NONE / FULL |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
             "| ---: | ---: |"]
    for b in batches:
        full = pd_ms(pdd, "FULL", b)
        lines.append("| %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |"
                     % (b, *(fmt(td.get((s, b))) for s in TORCH_SYSTEMS),
                        *(pd_cell(pdd, m, b) for m in PD_MODES),
                        fmt(ratio(td.get(("cuda_graph", b)), full), "%.2fx"),
                        fmt(ratio(td.get(("compile", b)), full), "%.2fx"),
                        fmt(ratio(pd_ms(pdd, "NONE", b), full), "%.2fx")))
    return lines


def prefill_table(t, p):
    tp, pp = torch_prefill(t), pd_prefill(p)
    lens = sorted({n for _, n in tp} | {n for _, n in pp})
    lines = ["### Prefill, batch 1 (ms)", "",
             "| tokens | torch eager | torch cuda_graph | torch compile | "
             "HF eager | pdworker NONE | pdworker PIECEWISE | pdworker FULL "
             "| best torch / best pdworker |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n in lens:
        torch_vals = [tp[(s, n)] for s in TORCH_SYSTEMS[:3] if (s, n) in tp]
        torch_best = min(torch_vals) if torch_vals else None
        pd_vals = [pd_ms(pp, m, n) for m in PD_MODES if pd_ms(pp, m, n)]
        lines.append("| %d | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            n, *(fmt(tp.get((s, n))) for s in TORCH_SYSTEMS),
            *(pd_cell(pp, m, n) for m in PD_MODES),
            fmt(ratio(torch_best, min(pd_vals) if pd_vals else None),
                "%.2fx")))
    return lines


def capture_table(t, p):
    lines = ["### Graph capture", "",
             "| system | phase | graphs | seconds | memory MiB (free-bytes "
             "drop) | reserved MiB | note |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for c in (t or {}).get("capture", []):
        lines.append("| torch %s | %s | %s | %.2f | %.1f | %s | %s |" % (
            c["system"], c.get("phase", ""), c.get("graphs", "—"),
            c["seconds"], c["memory_bytes"] / MIB,
            fmt(None if c.get("reserved_bytes") is None else
                c["reserved_bytes"] / MIB, "%.1f"), c.get("note", "")))
    for c in (p or {}).get("capture", []):
        lines.append("| pdworker %s | all | %s | %.2f | %.1f | — | |" % (
            c["mode"], c.get("graphs", "—"), c["seconds"],
            c["memory_bytes"] / MIB))
    return lines


def hbm_rows(t, p):
    """[(label, step ms, bytes/s, fraction or None)] at batch 1."""
    rows = []
    td, pdd = torch_decode(t), pd_decode(p)
    if t:
        total = t["weight_bytes"] + t["kv_bytes_batch1"]
        peak = t.get("peak_bytes_per_s") or 0
        for s in TORCH_SYSTEMS:
            if (s, 1) in td:
                bps = total / (td[(s, 1)] / 1e3)
                rows.append(("torch " + s, td[(s, 1)], bps,
                             bps / peak if peak else None))
    if p:
        total = p["weight_bytes"] + p.get("kv_bytes_batch1", 0)
        peak = p.get("peak_bytes_per_s") or (t or {}).get(
            "peak_bytes_per_s") or 0
        for m in PD_MODES:
            ms = pd_ms(pdd, m, 1)
            if ms:
                bps = total / (ms / 1e3)
                rows.append(("pdworker " + m, ms, bps,
                             bps / peak if peak else None))
    return rows


def hbm_table(t, p):
    peak = (p or {}).get("peak_bytes_per_s") or (t or {}).get(
        "peak_bytes_per_s")
    lines = ["### Batch 1: fraction of HBM bandwidth", "",
             "Bytes per step = decode weights (linear weights, norms, LM "
             "head, one embedding row) + KV of ~context tokens; peak %s." %
             ("%.2f TB/s" % (peak / 1e12) if peak else "unknown"), "",
             "| system | step ms | GB/s | % of peak |",
             "| --- | ---: | ---: | ---: |"]
    for label, ms, bps, frac in hbm_rows(t, p):
        lines.append("| %s | %.3f | %.0f | %s |" % (
            label, ms, bps / 1e9, fmt(frac and 100 * frac, "%.1f%%")))
    return lines


def compare_lines(compares):
    lines = ["### Correctness vs transformers (hf_compare.py)", ""]
    if not compares:
        return lines + ["No hf_compare output.", ""]
    lines += ["| mode | result | worst pdworker max diff | its tol | "
              "near-tie steps | mismatched steps | HF bf16 generate prefix "
              "(min over prompts) |", "| --- | --- | ---: | ---: | ---: | "
              "---: | ---: |"]
    for c in compares:
        for m in c.get("modes", []):
            ps = m.get("prompts", [])
            worst = max(ps, key=lambda q: q["logits"]["pdworker"]["max"] -
                        q["logits"]["tol"]) if ps else None
            lines.append("| %s | %s | %s | %s | %d | %d | %s |" % (
                m.get("mode"), "PASS" if m.get("pass") else "FAIL",
                fmt(worst and worst["logits"]["pdworker"]["max"], "%.4f"),
                fmt(worst and worst["logits"]["tol"], "%.4f"),
                sum(q["greedy"]["near_ties"] for q in ps),
                sum(len(q["greedy"]["mismatches"]) for q in ps),
                min([q["generate_bf16_prefix"] for q in ps] or [0])))
        for e in c.get("errors", []):
            lines.append("- hf_compare error: %s" % e)
    return lines + [""]


# ----------------------------------------------------------------------------
# Targets


def targets(t, p, shape):
    """[(name, stated for, status, numbers)]"""
    td, pdd = torch_decode(t), pd_decode(p)
    out = []
    frac = next((f for label, _, _, f in hbm_rows(t, p)
                 if label == "pdworker FULL"), None)
    out.append(("FULL decode at batch 1 >= 80% of HBM roofline", "llama_1b",
                _status(frac, lambda f: f >= 0.80),
                "%s of peak" % fmt(frac and 100 * frac, "%.1f%%")))
    full1, none1 = pd_ms(pdd, "FULL", 1), pd_ms(pdd, "NONE", 1)
    r = ratio(none1, full1)
    out.append(("FULL >= 1.5x NONE at batch 1", "llama_0p5b",
                _status(r, lambda x: x >= 1.5),
                "NONE %s ms / FULL %s ms = %s" % (fmt(none1), fmt(full1),
                                                  fmt(r, "%.2fx"))))
    worse, compared = [], 0
    for b in sorted({b for _, b in pdd if b <= 64}):
        full, best = pd_ms(pdd, "FULL", b), best_torch_graph(td, b)
        if full is None or best is None:
            continue
        compared += 1
        if not full < best[0]:
            worse.append("B=%d: FULL %.3f vs %s %.3f" % (b, full, best[1],
                                                          best[0]))
    status = "no data" if not compared else ("met" if not worse
                                             else "not met")
    out.append(("pdworker faster than PyTorch CUDA graphs at every batch "
                "<= 64", "both", status,
                "%d batch sizes compared; %s" % (
                    compared, "; ".join(worse) if worse else
                    "FULL faster at all")))
    cap = next((c for c in (p or {}).get("capture", [])
                if c.get("mode") == "FULL"), None)
    if cap is None:
        out.append(("all decode graphs captured in < 2 s and < 64 MiB",
                    "both", "no data", "no pdworker FULL capture record"))
    else:
        ok = cap["seconds"] < 2.0 and cap["memory_bytes"] < 64 * MIB
        out.append(("all decode graphs captured in < 2 s and < 64 MiB",
                    "both", "met" if ok else "not met",
                    "%s graphs in %.2f s, %.1f MiB" % (
                        cap.get("graphs", "?"), cap["seconds"],
                        cap["memory_bytes"] / MIB)))
    return [(name, stated, status, numbers,
             stated in ("both", shape)) for name, stated, status, numbers
            in out]


def _status(value, ok):
    if value is None:
        return "no data"
    return "met" if ok(value) else "not met"


def target_lines(t, p, shape):
    lines = ["### Issue 10 targets (%s)" % shape, "",
             "| target | stated for | status | numbers |",
             "| --- | --- | --- | --- |"]
    for name, stated, status, numbers, applies in targets(t, p, shape):
        shown = status if applies else "(%s; informational here)" % status
        lines.append("| %s | %s | %s | %s |" % (name, stated, shown,
                                                numbers))
    return lines


# ----------------------------------------------------------------------------


def render(t, p, compares, shape, problems):
    lines = ["## %s" % shape, ""]
    for src, label in ((t, "torch"), (p, "pdworker")):
        if src:
            lines.append("- %s: %s, %s, context %s" % (
                label, src.get("device"), src.get("model_dir"),
                src.get("context")))
    if t:
        lines.append("- torch %s (CUDA %s); %d reps, median" % (
            t.get("torch"), t.get("cuda"), t.get("reps", 0)))
        for e in t.get("errors", []):
            lines.append("- torch_bench error: %s %s: %s" % (
                e["system"], e["phase"], e["error"][:300]))
        for s in t.get("skipped", []):
            lines.append("- skipped: torch %s %s (%s)" % (
                s["system"], s.get("phase", ""), s["reason"]))
    for prob in problems:
        lines.append("- missing input: %s" % prob)
    lines.append("")
    for block in (decode_table(t, p), prefill_table(t, p),
                  capture_table(t, p), hbm_table(t, p),
                  compare_lines(compares), target_lines(t, p, shape)):
        lines += block + [""]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--torch", required=True, help="torch_bench.py JSON")
    ap.add_argument("--pdworker", required=True,
                    help="gpu_decode_bench --json_out JSON")
    ap.add_argument("--compare", action="append", default=[],
                    help="hf_compare.py JSON (repeatable)")
    ap.add_argument("--shape", help="shape name (default: from the config)")
    a = ap.parse_args(argv)
    problems = []
    t = load(a.torch, problems)
    p = load(a.pdworker, problems)
    compares = [c for c in (load(x, problems) for x in a.compare) if c]
    shape = a.shape or guess_shape(t, p)
    sys.stdout.write(render(t, p, compares, shape, problems) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
