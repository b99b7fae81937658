#!/usr/bin/env bash
# GPU smoke test and benchmark: run on a machine with CUDA after `make setup`.
#  1. fp32, greedy: every drafter's output equals plain decoding (identical_to_none == 1.0).
#  2. bf16: the benchmark table (plain, Lyanna, EAGLE) at batch 1 and 16.
#  3. bf16, temperature 1: the same configurations sampled at batch 16.
#  4. the Triton kernels against their references, and their timings (python -m lyanna_kernels.bench).
#  5. bf16, deterministic mode: its cost against the default at batch 1 and 16, and its outputs equal to plain
#     decoding's with Lyanna speculating (identical_to_none == 1.0 in bf16).
# Every stage runs even when an earlier one failed; the exit status says whether all passed.
# Settings (environment): DEVICE (cuda), OUT (/tmp/gpu-smoke), PROMPTS (a prompts file; made from ShareGPT's
# held-out side when unset), EQ_PROMPTS/EQ_TOKENS (8/64), B1_PROMPTS (8), B16_PROMPTS (32), TOKENS (128),
# STAGES (equality,bench,sampled,kernels,deterministic), BENCH_ARGS (more engines.bench flags).
# A dry run on CPU: DEVICE=cpu EQ_PROMPTS=2 EQ_TOKENS=8 B1_PROMPTS=1 B16_PROMPTS=2 TOKENS=8 bash scripts/gpu_smoke.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-/tmp/gpu-smoke}
STAGES=${STAGES:-equality,bench,sampled,kernels,deterministic}
mkdir -p "$OUT"
failed=()
stage() { [[ ",$STAGES," == *",$1,"* ]]; }
run() {  # run NAME CMD...: time one step, keep its log, remember a failure
  local name=$1; shift
  local start=$SECONDS
  echo "== $name"
  if "$@" >"$OUT/$name.log" 2>&1; then echo "== $name ok ($((SECONDS - start)) s)"
  else echo "== $name FAILED ($((SECONDS - start)) s)"; tail -25 "$OUT/$name.log"; failed+=("$name"); fi
}
PROMPTS=${PROMPTS:-$OUT/prompts.jsonl}
[[ -s "$PROMPTS" ]] || $PY -m engines.datasets --source sharegpt --split val --num 32 --out "$PROMPTS"
BENCH=($PY -m engines.bench --device "$DEVICE" --prompts "$PROMPTS" ${BENCH_ARGS:-})

if stage equality; then
  run equality "${BENCH[@]}" --dtype float32 --num-prompts "${EQ_PROMPTS:-8}" --max-new-tokens "${EQ_TOKENS:-64}" \
    --batch-size 4 --compare none,lyanna,eagle,ngram
  $PY - "$OUT/equality.log" <<'PYEOF' || failed+=(equality-check)
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
bad = {n: c["identical_to_none"] for n, c in r["configs"].items() if n != "none" and c["identical_to_none"] != 1.0}
print("greedy equality on", r["device"], ":", "OK" if not bad else f"FAILED {bad}")
print({n: {k: c.get(k) for k in ("tokens_per_s", "mean_accepted_tokens")} for n, c in r["configs"].items()})
sys.exit(1 if bad else 0)
PYEOF
fi

if stage bench; then
  for b in 1 16; do
    n=${B16_PROMPTS:-32}; [[ $b == 1 ]] && n=${B1_PROMPTS:-8}
    run "bench-b$b" "${BENCH[@]}" --dtype bfloat16 --num-prompts "$n" --max-new-tokens "${TOKENS:-128}" \
      --batch-size $b --spec-depth 3 --spec-width 2 --spec-budget 6 --compare none,lyanna,eagle
    $PY -c "import json,sys; r=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); \
print('batch', r['batch_size'], {n: round(c['tokens_per_s'], 1) for n, c in r['configs'].items()})" \
      "$OUT/bench-b$b.log" || failed+=("bench-b$b-table")
  done
fi

# 3. Sampled decoding (temperature 1) at batch 16: the rejection sampler's kernels run.
if stage sampled; then
  run sampled "${BENCH[@]}" --dtype bfloat16 --num-prompts "${B16_PROMPTS:-32}" --max-new-tokens "${TOKENS:-128}" \
    --batch-size 16 --temperature 1.0 --seed 0 --compare none,lyanna,eagle
  tail -1 "$OUT/sampled.log" | $PY -c "import json,sys; r=json.loads(sys.stdin.read()); \
print('sampled batch 16', {n: (round(c['tokens_per_s'], 1), c.get('mean_accepted_tokens')) for n, c in r['configs'].items()})" \
    || failed+=(sampled-table)
fi

# 4. Triton kernels (the default on CUDA, used by 1 and 2): each against its PyTorch reference, then timed.
if stage kernels; then
  run kernel-tests $PY -m pytest -q -p no:cacheprovider tests/kernels
  run kernel-bench $PY -m lyanna_kernels.bench --device "$DEVICE" --dtype bfloat16
  tail -1 "$OUT/kernel-bench.log"
fi

# 5. The deterministic mode (batch-invariant kernels): what it costs, and that bf16 outputs no longer depend on the batch.
if stage deterministic; then
  for b in 1 16; do
    n=${B16_PROMPTS:-32}; [[ $b == 1 ]] && n=${B1_PROMPTS:-8}
    run "deterministic-b$b" "${BENCH[@]}" --dtype bfloat16 --num-prompts "$n" --max-new-tokens "${TOKENS:-128}" \
      --batch-size $b --compare none,none+deterministic,lyanna,lyanna+deterministic
    $PY -c "import json,sys; r=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); c=r['configs']; \
print('batch', r['batch_size'], {n: round(v['tokens_per_s'], 1) for n, v in c.items()}, 'cost', \
round(c['none+deterministic']['tokens_per_s'] / c['none']['tokens_per_s'], 3))" "$OUT/deterministic-b$b.log" \
      || failed+=("deterministic-b$b-table")
  done
  run deterministic-equality "${BENCH[@]}" --dtype bfloat16 --deterministic --num-prompts "${B16_PROMPTS:-32}" \
    --max-new-tokens "${TOKENS:-128}" --batch-size 16 --compare none,lyanna,eagle
  $PY - "$OUT/deterministic-equality.log" <<'PYEOF' || failed+=(deterministic-equality-check)
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
bad = {n: c["identical_to_none"] for n, c in r["configs"].items() if n != "none" and c["identical_to_none"] != 1.0}
print("bf16 deterministic equality on", r["device"], ":", "OK" if not bad else f"FAILED {bad}")
sys.exit(1 if bad else 0)
PYEOF
fi

if ((${#failed[@]})); then echo "FAILED: ${failed[*]}"; exit 1; fi
echo "all stages passed"
