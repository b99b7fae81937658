"""Inference engine: model runner, paged KV cache, scheduler, sampler and drafters."""
