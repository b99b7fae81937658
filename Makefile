# `make run` and `make test` do all set-up on a fresh machine (scripts/setup.sh is idempotent).
PY ?= python3
PROMPT ?= Explain speculative decoding in two sentences.

.PHONY: setup run test lint bench
setup:
	PYTHON=$(PY) bash scripts/setup.sh

run: setup
	$(PY) -m engines.generate --prompt "$(PROMPT)"

test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -q

bench: setup
	$(PY) -m engines.datasets --source sharegpt --num 32 --out /tmp/sharegpt-32.jsonl
	$(PY) -m engines.bench --prompts /tmp/sharegpt-32.jsonl --num-prompts 8 --max-new-tokens 64 --batch-size 1 --compare-hf
