"""Shared fixtures: the embedded model's checkpoint, engines on it, and transformers' reference model."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run on CPU tensors in Triton's interpreter; it must be on before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engines.engine import EngineConfig, LLMEngine
from engines.loader import resolve_checkpoint
from serve_app.app import use_serve_cluster_env

# The Ray clusters the tests start serve as `make run`'s does (HAProxy ingress); set before any of them starts.
use_serve_cluster_env()

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three prime numbers."}],
    [
        {
            "role": "user",
            "content": "Explain in a short paragraph why the sky is blue, the way you would to a curious "
            "ten-year-old who keeps asking why after each answer you give.",
        }
    ],
]


@pytest.fixture(scope="session")
def checkpoint():
    """Folder of the converted embedded model."""
    return resolve_checkpoint()


@pytest.fixture(scope="session")
def engine_fp32():
    """An fp32 engine on the embedded model (exact comparisons against transformers)."""
    return LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=512, drafter="none"))


@pytest.fixture(scope="session")
def hf_fp32(checkpoint):
    """transformers' LlamaForCausalLM on the same checkpoint, fp32."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


@pytest.fixture
def make_engine():
    """Build an engine with overrides; engines share the cached checkpoint, so this is cheap."""

    def make(**overrides) -> LLMEngine:
        cfg = {"dtype": "float32", "num_kv_blocks": 256, "drafter": "none"} | overrides
        return LLMEngine(EngineConfig(**cfg))

    return make
