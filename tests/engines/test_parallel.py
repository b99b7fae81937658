"""Tensor parallelism: a model sharded over 3 CPU ranks (gloo) computes what the unsharded one does."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from engines.loader import load_model
from engines.parallel import TensorParallel
from tests.engines.helpers import forward_one, new_cache

WORLD = 3


def forward_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits of a prompt, then of one decode step on top of the (sharded) cache."""
    kv = new_cache(model, num_blocks=8)
    logits, _ = forward_one(model, kv, "s", ids, 0)
    step, _ = forward_one(model, kv, "s", [3], len(ids))
    return torch.cat([logits, step])


def worker(rank: int, folder: str, ids: list[int], out_dir: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        tp = TensorParallel(world_size=WORLD, rank=rank, group=dist.group.WORLD)
        model = load_model(folder, dtype="float32", tp=tp).model
        assert model.attn_kv_heads == 1  # each rank holds one of the 3 KV heads
        torch.save(forward_logits(model, ids), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_three_way_tensor_parallel_matches_single_process(tmp_path):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        max_position_embeddings=128,
    )
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
    ids = torch.randint(0, 64, (11,)).tolist()
    reference = forward_logits(load_model(str(tmp_path / "ckpt"), dtype="float32").model, ids)

    port = 29500 + os.getpid() % 1000
    mp.spawn(worker, args=(str(tmp_path / "ckpt"), ids, str(tmp_path), port), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        torch.testing.assert_close(torch.load(tmp_path / f"rank{rank}.pt"), reference, rtol=1e-5, atol=1e-5)


def test_more_ranks_than_kv_heads_are_refused():
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=3,
    )
    from engines.config import ModelConfig
    from engines.model import LlamaModel

    with pytest.raises(ValueError, match="num_kv_heads=3 is fewer than the tensor-parallel size 4"):
        LlamaModel(ModelConfig.from_hf_dict(cfg.to_dict()), torch.float32, TensorParallel(world_size=4))
