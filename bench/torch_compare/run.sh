#!/usr/bin/env bash
# Issue 10, the whole comparison in one command on the GPU machine:
#
#   bench/torch_compare/run.sh OUTDIR
#
# For each shape (llama_0p5b, llama_1b): make_checkpoint (transformers,
# random bf16 weights, /tmp) -> make_prompts -> logits_probe NONE and FULL
# -> hf_compare -> torch_bench -> gpu_decode_bench -> report.py. Everything
# lands in OUTDIR (per shape: OUTDIR/<shape>/, logs: OUTDIR/logs/), with the
# combined tables in OUTDIR/report.md. A failing step is recorded and the
# run goes on; the exit status is 1 if any step failed.
#
# Needs: prebuilt pdworker binaries in .gpu/bin/ (logits_probe,
# gpu_decode_bench; override with PDW_BIN), Python with torch,
# transformers, safetensors and numpy (override with PYTHON). Sources
# .gpu/env.sh first if it exists.
#
# Knobs (environment): TORCH_COMPARE_SHAPES ("llama_0p5b llama_1b"),
# TORCH_COMPARE_REPS (20), TORCH_COMPARE_CONTEXT (512),
# TORCH_COMPARE_BATCHES (1,2,4,8,16,32,64,128,256),
# TORCH_COMPARE_PREFILL (64,128,256,512,1024,2048),
# TORCH_COMPARE_COMPILE (torch.compile phases: "decode"; "decode,prefill"
# adds ~2 compilations per shape; "none"), TORCH_COMPARE_SYSTEMS (torch
# baselines: eager,cuda_graph,compile,hf_eager), TORCH_COMPARE_CKPT
# (/tmp/torch_compare).
# For a flow test without a GPU or transformers: TORCH_COMPARE_DEVICE=cpu
# TORCH_COMPARE_BACKEND=builtin TORCH_COMPARE_SHAPES=tiny.
set -u

if [ $# -ne 1 ]; then
  echo "usage: $0 OUTDIR" >&2
  exit 2
fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT" || exit 2
mkdir -p "$1" || exit 2
OUT="$(cd "$1" && pwd)"
if [ -f .gpu/env.sh ]; then
  # shellcheck disable=SC1091
  source .gpu/env.sh
fi

PY="${PYTHON:-python3}"
BIN="${PDW_BIN:-$ROOT/.gpu/bin}"
SHAPES="${TORCH_COMPARE_SHAPES:-llama_0p5b llama_1b}"
REPS="${TORCH_COMPARE_REPS:-20}"
CONTEXT="${TORCH_COMPARE_CONTEXT:-512}"
BATCHES="${TORCH_COMPARE_BATCHES:-1,2,4,8,16,32,64,128,256}"
PREFILL="${TORCH_COMPARE_PREFILL:-64,128,256,512,1024,2048}"
COMPILE="${TORCH_COMPARE_COMPILE:-decode}"  # "none": no torch.compile
SYSTEMS="${TORCH_COMPARE_SYSTEMS:-eager,cuda_graph,compile,hf_eager}"
DEVICE="${TORCH_COMPARE_DEVICE:-cuda}"          # cpu: flow test only
BACKEND="${TORCH_COMPARE_BACKEND:-transformers}"  # builtin: no transformers
CKPT_ROOT="${TORCH_COMPARE_CKPT:-/tmp/torch_compare}"
LOGS="$OUT/logs"
STATUS="$OUT/steps.tsv"
mkdir -p "$LOGS"
printf 'step\tstatus\tseconds\n' > "$STATUS"
FAILED=0
RUN_START=$(date +%s)

# step NAME TIMEOUT_S [--stdout FILE] CMD...: runs CMD with a time limit,
# stdout+stderr to logs/NAME.log (or stdout to FILE, stderr to the log),
# and records the outcome. Never stops the run.
step() {
  local name="$1" limit="$2"
  shift 2
  local stdout_file=""
  if [ "${1:-}" = "--stdout" ]; then
    stdout_file="$2"
    shift 2
  fi
  local log="$LOGS/$name.log" start rc
  start=$(date +%s)
  echo "[$(date +%T)] $name: $*" | tee -a "$OUT/run.log"
  if [ -n "$stdout_file" ]; then
    timeout --kill-after=10 "$limit" "$@" > "$stdout_file" 2> "$log"
  else
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
  fi
  rc=$?
  local took=$(( $(date +%s) - start )) status="ok"
  if [ $rc -ne 0 ]; then
    status="FAILED (exit $rc$([ $rc -eq 124 ] && echo ", timed out after ${limit}s"))"
    FAILED=1
  fi
  printf '%s\t%s\t%s\n' "$name" "$status" "$took" >> "$STATUS"
  echo "[$(date +%T)] $name: $status in ${took}s" | tee -a "$OUT/run.log"
  return $rc
}

skip() {
  printf '%s\t%s\t0\n' "$1" "skipped ($2)" >> "$STATUS"
  echo "$1: skipped ($2)" | tee -a "$OUT/run.log"
  FAILED=1
}

# Environment record: GPU, driver, versions, commit, date.
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  # The binaries' commit (scripts/gpu-bundle writes it); the device
  # machine's .git can be older than the tree it was sent.
  echo "commit: $(cat "$BIN/../commit.txt" 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory \
    --format=csv 2>/dev/null || echo "nvidia-smi unavailable"
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
  "$PY" -c 'import transformers; print("transformers", transformers.__version__)' 2>/dev/null \
    || echo "transformers: not importable"
} > "$OUT/env.txt"

for shape in $SHAPES; do
  D="$OUT/$shape"
  CKPT="$CKPT_ROOT/$shape"
  mkdir -p "$D"
  step "$shape.make_checkpoint" 300 \
    "$PY" "$HERE/make_checkpoint.py" --shape "$shape" --out "$CKPT" --reuse \
    --backend "$BACKEND"
  if [ ! -f "$CKPT/config.json" ]; then
    for s in make_prompts probe_NONE probe_PIECEWISE probe_FULL hf_compare torch_bench \
             gpu_decode_bench report; do
      skip "$shape.$s" "no checkpoint"
    done
    continue
  fi
  VOCAB=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$CKPT/config.json")
  step "$shape.make_prompts" 60 \
    "$PY" "$HERE/make_prompts.py" --vocab "$VOCAB" --out "$D/prompts.json"

  PROBES=()
  for mode in NONE PIECEWISE FULL; do
    mkdir -p "$D/probe_$mode"
    if step "$shape.probe_$mode" 300 \
        "$BIN/logits_probe" --model_dir="$CKPT" --device="$DEVICE" --mode="$mode" \
        --prompts="$D/prompts.json" --greedy_steps=64 \
        --decode_logits_steps=4 --out_dir="$D/probe_$mode"; then
      PROBES+=(--pdworker_out "$D/probe_$mode")
    fi
  done
  if [ ${#PROBES[@]} -gt 0 ]; then
    step "$shape.hf_compare" 420 --stdout "$D/compare.md" \
      "$PY" "$HERE/hf_compare.py" --model "$CKPT" "${PROBES[@]}" \
      --out "$D/compare.json"
  else
    skip "$shape.hf_compare" "no probe output"
  fi

  step "$shape.torch_bench" 480 \
    "$PY" "$HERE/torch_bench.py" --model "$CKPT" --out "$D/torch.json" \
    --batches "$BATCHES" --prefill_lens "$PREFILL" --context "$CONTEXT" \
    --reps "$REPS" --compile_scope "$COMPILE" --device "$DEVICE" \
    --systems "$SYSTEMS"
  step "$shape.gpu_decode_bench" 420 \
    "$BIN/gpu_decode_bench" --model_dir="$CKPT" --json_out="$D/pdworker.json" \
    --batches="$BATCHES" --prefill_lens="$PREFILL" --context="$CONTEXT" \
    --reps="$REPS" --device="$DEVICE" --skip_attention
  COMPARE=()
  [ -f "$D/compare.json" ] && COMPARE=(--compare "$D/compare.json")
  step "$shape.report" 60 --stdout "$D/report.md" \
    "$PY" "$HERE/report.py" --torch "$D/torch.json" \
    --pdworker "$D/pdworker.json" ${COMPARE[@]+"${COMPARE[@]}"} \
    --shape "$shape"
done

# Combined report.
{
  echo "# PyTorch / transformers vs pdworker (issue 10)"
  echo
  echo '```'
  cat "$OUT/env.txt"
  echo '```'
  echo
  echo "Command: \`bench/torch_compare/run.sh $1\` (reps $REPS, context" \
       "$CONTEXT, torch.compile phases: $COMPILE); total" \
       "$(( $(date +%s) - RUN_START )) s."
  echo
  echo "| step | status | seconds |"
  echo "| --- | --- | ---: |"
  tail -n +2 "$STATUS" | awk -F'\t' '{printf "| %s | %s | %s |\n", $1, $2, $3}'
  echo
  for shape in $SHAPES; do
    if [ -f "$OUT/$shape/report.md" ]; then
      cat "$OUT/$shape/report.md"
    else
      echo "## $shape"
      echo
      echo "No report (see the step table and logs/)."
    fi
    echo
    if [ -f "$OUT/$shape/compare.md" ]; then
      sed 's/^## /### /; s/^### mode/#### mode/' "$OUT/$shape/compare.md"
      echo
    fi
  done
} > "$OUT/report.md"

echo "report: $OUT/report.md"
if [ $FAILED -ne 0 ]; then
  echo "some steps failed; see $OUT/steps.tsv and $OUT/logs/" >&2
  exit 1
fi
exit 0
