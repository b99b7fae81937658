"""Inference engine: scheduler, speculative step executor (spec_decode/), drafters, verification,
model runner, paged KV cache, sampler; measurement CLIs in bench/ and drafter training in training/."""
