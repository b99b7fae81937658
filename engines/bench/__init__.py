"""Measurement tools, apart from the engine: each module is a command line that prints JSON.

- `python -m engines.bench`: decoding throughput, our configurations side by side (and peers)
- `python -m engines.bench.acceptance` (also `python -m engines.acceptance`): acceptance by draft step
- `python -m engines.bench.draft_latency`: a draft step's latency, piece by piece
- `python -m engines.bench.verify_latency`: the cost of verifying sampled draft trees
- `python -m engines.bench.interference`: how long prompts and contexts disturb a batch
- `python -m engines.bench.quality`: how much each weight setting changes the model's answers
- `python -m engines.bench.structured`: JSON-schema outputs under speculation against free text (validity,
  tokens/s ratio), and `--libraries`: xgrammar against llguidance

`llamacpp_peer` runs llama.cpp as a peer for `engines.bench --compare-llamacpp`, `vllm_peer` vLLM's CPU build
(`vllm_worker`, in vLLM's own virtual environment) for `--compare-vllm`; `wave` holds what every side
reports for a wave (end-to-end and decode-only clocks) and the machine's CPU description.
"""
