# `make run` and `make test` do all set-up on a fresh machine (scripts/setup.sh is idempotent).
PY ?= python3
PROMPT ?= Explain speculative decoding in two sentences.

.PHONY: setup run generate test lint bench
setup:
	PYTHON=$(PY) bash scripts/setup.sh

# The OpenAI-compatible server on 127.0.0.1:8000 (embedded model + shipped Lyanna drafter).
run: setup
	RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=5 serve run serve_config.yaml

# One completion offline, without the server.
generate: setup
	$(PY) -m engines.generate --prompt "$(PROMPT)"

test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -q

bench: setup
	$(PY) -m engines.datasets --source sharegpt --num 32 --out /tmp/sharegpt-32.jsonl
	$(PY) -m engines.bench --prompts /tmp/sharegpt-32.jsonl --num-prompts 8 --max-new-tokens 64 --batch-size 1 --compare-hf
