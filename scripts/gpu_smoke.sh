#!/usr/bin/env bash
# GPU smoke test and benchmark: run on a machine with CUDA after `make setup`.
#  1. fp32, greedy: every drafter's output equals plain decoding (identical_to_none == 1.0).
#  2. bf16: the benchmark table (plain, Lyanna, EAGLE) at batch 1 and 16.
#  3. the Triton kernels against their references, and their timings (python -m kernels.bench).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu-smoke}
mkdir -p "$OUT"
$PY -m engines.datasets --source sharegpt --split val --num 32 --out "$OUT/prompts.jsonl"
$PY -m engines.bench --device cuda --dtype float32 --prompts "$OUT/prompts.jsonl" --num-prompts 8 \
  --max-new-tokens 64 --batch-size 4 --compare none,lyanna,eagle,ngram | tail -1 > "$OUT/equality.json"
$PY - "$OUT/equality.json" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
bad = {n: c["identical_to_none"] for n, c in r["configs"].items() if n != "none" and c["identical_to_none"] != 1.0}
print("greedy equality on", r["device"], ":", "OK" if not bad else f"FAILED {bad}")
sys.exit(1 if bad else 0)
PYEOF
for b in 1 16; do
  $PY -m engines.bench --device cuda --dtype bfloat16 --prompts "$OUT/prompts.jsonl" --num-prompts 32 \
    --max-new-tokens 128 --batch-size $b --depth 3 --width 2 --budget 6 --compare none,lyanna,eagle \
    | tail -1 > "$OUT/bench-b$b.json"
  $PY -c "import json,sys; r=json.load(open(sys.argv[1])); print('batch', r['batch_size'], {n: round(c['tokens_per_s'], 1) for n, c in r['configs'].items()})" "$OUT/bench-b$b.json"
done
# 3. Triton kernels (the default on CUDA, used by 1 and 2): each against its PyTorch reference, then timed.
$PY -m pytest -q tests/kernels
$PY -m kernels.bench --device cuda --dtype bfloat16 | tail -1 | tee "$OUT/kernels.json"
