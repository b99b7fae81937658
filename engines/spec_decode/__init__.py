"""The speculative step executor and what it runs inside one step.

- `executor.py`: one scheduled step, end to end: drafting, the in-step policy's allocation, the target
  forward, sampling and verification, the batched KV commit; a typed result per request.
- `policy.py`: the in-step speculation policy (fixed trees, or goodput-maximising adaptive trees),
  with its models of acceptance (`acceptance_model.py`) and step cost (`cost_model.py`), seeded at
  start-up by `profile.py`.
- `stats.py`: speculation counters.

Drafters live in engines/drafters/, the verifiers in engines/verification.py.
"""
