"""Qwen2/Qwen2.5 and Mistral checkpoints on every path, against transformers' own forward.

With no model hub here, each family is a tiny random checkpoint that transformers builds from its config
(`Qwen2Config`, `MistralConfig`) and saves with the embedded model's tokenizer. Qwen2's q/k/v biases are
drawn at random (transformers initialises them to zero, which would hide a bias that is never added), its
RoPE base is 1e6 as Qwen2.5's; the Mistral one has a head_dim that is not hidden / heads. Paths: the eager
model (logits and greedy generation against transformers), int8/int4 weights (against transformers over the
dequantized weights; biases stay fp32), the fused CPU decoder (against the eager layers over the same
weights), two tensor-parallel ranks, speculation with every drafter, and a drafter trained by
`python -m engines.training` for a Qwen2 target.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engines.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError
from engines.drafters.eagle_model import EagleDraftModel
from engines.drafters.lyanna_model import LyannaDraftModel
from engines.engine import EngineConfig, LLMEngine
from engines.errors import ContextLengthError
from engines.loader import load_model, resolve_checkpoint
from engines.parallel import TensorParallel
from engines.sampling import SamplingParams
from lyanna_kernels import integer_dot
from tests.engines.helpers import forward_one, new_cache, random_draft_checkpoint

VOCAB = 49152  # the embedded model's tokenizer, which every tiny checkpoint ships with
MAX_NEW = 16
PROMPTS = [[5, 17, 33, 2 + i, 99, 7 * i + 1] * (i + 2) for i in range(2)] + [list(range(400, 437))]

# name -> (transformers config class, its settings); every one: hidden 64, 2 layers, 4 query heads over 2 KV heads.
FAMILIES = {
    "qwen2": ("Qwen2Config", {"rope_theta": 1e6, "tie_word_embeddings": True, "rms_norm_eps": 1e-6}),
    # As Qwen2.5's configs: a sliding_window value with use_sliding_window false (no window), untied head.
    "qwen2-untied": (
        "Qwen2Config",
        {"rope_theta": 1e6, "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 32768},
    ),
    # head_dim 32 != 64 / 4; a window as long as the context (no cap).
    "mistral": ("MistralConfig", {"head_dim": 32, "sliding_window": 1024, "tie_word_embeddings": False}),
}


def tiny_checkpoint(folder: Path, config_class: str, max_positions: int = 1024, seed: int = 0, **settings) -> Path:
    """A seeded random checkpoint of a transformers config class, saved with the embedded model's tokenizer;
    q/k/v biases (Qwen2) and norm weights are drawn at random too."""
    import transformers

    torch.manual_seed(seed)
    base = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": max_positions,
    }
    cfg = getattr(transformers, config_class)(**(base | settings))
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (resolve_checkpoint() / name).exists():
            shutil.copy(resolve_checkpoint() / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, str]:
    """Folder of each tiny family checkpoint."""
    return {
        name: str(tiny_checkpoint(tmp_path_factory.mktemp(name), cls, **settings))
        for name, (cls, settings) in FAMILIES.items()
    }


def hf_model(folder: str):
    """transformers' own model on a checkpoint folder, fp32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def prompt_and_steps(model, ids: list[int], steps: list[int], block_size: int = 4) -> torch.Tensor:
    """Logits of a prompt, then of one decode step per token of `steps` on top of the cache: [len + steps, V]."""
    kv = new_cache(model, num_blocks=64, block_size=block_size, dtype=torch.float32)
    logits, _ = forward_one(model, kv, "s", ids, 0)
    rows = [logits]
    for i, tok in enumerate(steps):
        rows.append(forward_one(model, kv, "s", [tok], len(ids) + i)[0])
    return torch.cat(rows)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `prompt`, `n` tokens (a full forward each step, no EOS)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def make_engine(model: str, **overrides) -> LLMEngine:
    cfg = {
        "model": model,
        "dtype": "float32",
        "num_kv_blocks": 96,
        "block_size": 4,  # prompts and draft trees cross block boundaries
        "max_num_seqs": 4,
        "drafter": "none",
        "spec_depth": 3,
        "spec_width": 2,
        "spec_budget": 6,
    }
    return LLMEngine(EngineConfig(**(cfg | overrides)))


def greedy(e: LLMEngine, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    return [c.token_ids for c in e.generate(prompts, params)]


def sampled(e: LLMEngine, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    params = [SamplingParams(temperature=0.8, seed=7 + i, max_tokens=MAX_NEW, ignore_eos=True) for i in range(3)]
    return [c.token_ids for c in e.generate(prompts, params)]


# ---- config: what loads and what is refused ------------------------------------------------------------
def test_family_configs_are_read_as_transformers_reads_them(families):
    for name, folder in families.items():
        cfg = ModelConfig.from_json_file(Path(folder) / "config.json")
        hf = json.loads((Path(folder) / "config.json").read_text())
        assert SUPPORTED_ARCHITECTURES[cfg.architecture] == hf["model_type"]
        assert cfg.qkv_bias == (hf["model_type"] == "qwen2")
        assert cfg.sliding_window is None or cfg.sliding_window >= 1024
        assert cfg.max_position_embeddings == 1024
        assert cfg.tie_word_embeddings == FAMILIES[name][1]["tie_word_embeddings"]
    assert ModelConfig.from_json_file(Path(families["qwen2"]) / "config.json").rope_theta == 1e6
    assert ModelConfig.from_json_file(Path(families["mistral"]) / "config.json").head_dim == 32


def test_other_architectures_are_refused_by_name(tmp_path):
    from transformers import GPT2Config, LlamaConfig

    gpt2 = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).to_dict() | {"architectures": ["GPT2LMHeadModel"]}
    (tmp_path / "config.json").write_text(json.dumps(gpt2))
    with pytest.raises(UnsupportedModelError) as err:
        load_model(str(tmp_path))
    message = str(err.value)
    assert "GPT2LMHeadModel" in message and all(arch in message for arch in SUPPORTED_ARCHITECTURES)
    moe = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"}
    with pytest.raises(UnsupportedModelError, match=r"Qwen2MoeForCausalLM.*supported: LlamaForCausalLM"):
        ModelConfig.from_hf_dict(moe)
    with pytest.raises(UnsupportedModelError, match="model_type 'gemma'"):
        ModelConfig.from_hf_dict({"model_type": "gemma"})
    biased = LlamaConfig(attention_bias=True).to_dict() | {"architectures": ["LlamaForCausalLM"]}
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        ModelConfig.from_hf_dict(biased)
    gelu = LlamaConfig(hidden_act="gelu").to_dict()
    with pytest.raises(UnsupportedModelError, match="hidden_act='gelu'"):
        ModelConfig.from_hf_dict(gelu)


def test_a_checkpoint_with_weights_the_config_does_not_describe_is_refused(families, tmp_path):
    """A Qwen2 checkpoint whose config says Llama would lose its biases: refused, naming them."""
    folder = tmp_path / "mislabelled"
    shutil.copytree(families["qwen2"], folder)
    cfg = json.loads((folder / "config.json").read_text()) | {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.self_attn\.k_proj\.bias"):
        load_model(str(folder), dtype="float32")


# ---- the eager model against transformers ----------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(families, family):
    ours = load_model(families[family], dtype="float32").model
    hf = hf_model(families[family])
    if family.startswith("qwen2"):
        assert ours.layers[0].attn.qkv_proj.bias.abs().max() > 0.1  # the biases arrived
    ids = torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    steps = [11, 4000, 42]
    got = prompt_and_steps(ours, ids, steps)
    with torch.no_grad():
        want = hf(torch.tensor([ids + steps])).logits[0]
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_matches_transformers_token_for_token(families, family):
    e = make_engine(families[family])
    hf = hf_model(families[family])
    got = greedy(e)
    assert got == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    assert e.stats().kv_free_blocks == 96


# ---- sliding windows: capped context, exact inside it --------------------------------------------------------
@pytest.mark.parametrize(
    ("config_class", "settings"),
    [
        ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1}),
        ("MistralConfig", {"sliding_window": 24}),
    ],
    ids=["qwen2-use_sliding_window", "mistral-window"],
)
def test_a_sliding_window_caps_the_context_and_is_exact_inside_it(tmp_path, config_class, settings):
    """A window shorter than the context: the engine serves up to the window (where it is full attention)
    and equals transformers' windowed model there; a longer prompt is refused."""
    folder = str(tiny_checkpoint(tmp_path, config_class, max_positions=256, **settings))
    e = make_engine(folder)
    assert e.model_config.sliding_window == 24 and e.max_model_len == 24
    ids = list(range(300, 323))  # 23 + one decode step: 24 tokens, the whole window
    got = prompt_and_steps(e.model, ids, [7])
    with torch.no_grad():
        want = hf_model(folder)(torch.tensor([[*ids, 7]])).logits[0]
    assert rel_err(got, want) < 1e-5
    with pytest.raises(ContextLengthError, match="maximum context length is 24"):
        e.add_request(None, SamplingParams(max_tokens=4), prompt_token_ids=list(range(300, 322)))
    with pytest.raises(IndexError):  # the model itself refuses a position past the window
        e.model.rotary(torch.tensor([24]), torch.float32)


def test_qwen2_window_settings_follow_transformers():
    """use_sliding_window false: no window whatever sliding_window says; true: only when some layer slides."""
    base = {"model_type": "qwen2", "num_hidden_layers": 4, "sliding_window": 8}
    from engines.config import sliding_window_of

    assert sliding_window_of("Qwen2ForCausalLM", base | {"use_sliding_window": False}) is None
    assert sliding_window_of("Qwen2ForCausalLM", base | {"use_sliding_window": True, "max_window_layers": 4}) is None
    assert sliding_window_of("Qwen2ForCausalLM", base | {"use_sliding_window": True, "max_window_layers": 3}) == 8
    assert sliding_window_of("Qwen2ForCausalLM", base | {"layer_types": ["full_attention"] * 4}) is None
    assert sliding_window_of("MistralForCausalLM", {"sliding_window": None}) is None
    assert sliding_window_of("LlamaForCausalLM", {"sliding_window": 8}) is None


# ---- quantized weights: biases stay fp32 -------------------------------------------------------------------
def dequantized_hf(folder: str, ours) -> torch.nn.Module:
    """transformers' model on `folder` with every projection and the LM head replaced by our quantized
    model's dequantized values (an fp32 model keeps exactly those: `PackableLinear.take`)."""
    hf = hf_model(folder)
    cfg = ours.cfg
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    with torch.no_grad():
        for mine, theirs in zip(ours.layers, hf.model.layers, strict=True):
            attn, mlp = theirs.self_attn, theirs.mlp
            qkv = mine.attn.qkv_proj.weight.split([q, kv, kv])
            for proj, w in zip((attn.q_proj, attn.k_proj, attn.v_proj), qkv, strict=True):
                proj.weight.copy_(w)
            attn.o_proj.weight.copy_(mine.attn.o_proj.weight)
            gate, up = mine.mlp.gate_up_proj.weight.chunk(2)
            mlp.gate_proj.weight.copy_(gate)
            mlp.up_proj.weight.copy_(up)
            mlp.down_proj.weight.copy_(mine.mlp.down_proj.weight)
        hf.lm_head.weight = torch.nn.Parameter(ours.lm_head_exact.clone())  # unties a tied head
    return hf


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_quantized_weights_match_transformers_over_the_dequantized_weights(families, family, kind):
    """int8/int4 weights (fp32 model: the quantized values exactly) against transformers over the same values;
    the biases are not quantized (they equal the checkpoint's)."""
    loaded = load_model(families[family], dtype="float32", quantization=kind)
    ours = loaded.model
    assert loaded.quantization == kind and ours.layers[0].attn.qkv_proj.quant_kind == kind
    hf = dequantized_hf(families[family], ours)
    plain = hf_model(families[family])
    assert not torch.equal(hf.model.layers[0].self_attn.q_proj.weight, plain.model.layers[0].self_attn.q_proj.weight)
    if family == "qwen2":
        want_bias = torch.cat([getattr(plain.model.layers[1].self_attn, f"{n}_proj").bias for n in "qkv"])
        assert torch.equal(ours.layers[1].attn.qkv_proj.bias, want_bias)
    ids = list(range(1000, 1040))
    got = prompt_and_steps(ours, ids, [5, 6])
    with torch.no_grad():
        want = hf(torch.tensor([[*ids, 5, 6]])).logits[0]
    assert rel_err(got, want) < 1e-5
    assert 1e-4 < rel_err(got, plain(torch.tensor([[*ids, 5, 6]])).logits[0].detach()) < 0.2  # quantized, close


# ---- the fused CPU decoder -----------------------------------------------------------------------------------
needs_fused = pytest.mark.skipif(not integer_dot.available(), reason="no AVX2 CPU or C compiler here")


@needs_fused
@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_fused_decoder_computes_the_eager_layers(families, family):
    """bf16 int8 weights: the fused CPU decoder (with Qwen2's biases) against the eager layers over the same
    weights; the biases' effect is far larger than their difference."""
    model = load_model(families[family], dtype="bfloat16", quantization="int8").model
    kv = new_cache(model, num_blocks=64, block_size=4, dtype=torch.float32)
    assert model.fused_decoder(kv, 1) is not None
    ids, steps = list(range(2000, 2037)), [9, 99]
    fused = prompt_and_steps(model, ids, steps)
    model.enforce_eager = True
    eager = prompt_and_steps(model, ids, steps)
    assert rel_err(fused, eager) < 2e-2
    if family == "qwen2":
        for layer in model.layers:
            layer.attn.qkv_proj.bias.zero_()
        assert rel_err(prompt_and_steps(model, ids, steps), eager) > 0.2


# ---- speculation: greedy equals plain decoding with every drafter ------------------------------------------------
@pytest.fixture(scope="module")
def drafter_checkpoints(families, tmp_path_factory) -> dict[tuple[str, str], str]:
    """Seeded random Lyanna and EAGLE drafters for each family's target."""
    out = {}
    for family in ("qwen2", "mistral"):
        e = make_engine(families[family])
        for kind, cls in (("lyanna", LyannaDraftModel), ("eagle", EagleDraftModel)):
            out[family, kind] = random_draft_checkpoint(cls, e, tmp_path_factory.mktemp(f"{kind}-{family}"))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["ngram", "lyanna", "eagle", "draft-model"])
@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_speculation_is_lossless_on_each_family(families, drafter_checkpoints, family, drafter):
    """Greedy outputs equal plain decoding's; so do seeded sampled ones with the deterministic-tree drafters
    (the draw at output index i uses the noise of (seed, i) however the token was verified)."""
    plain = make_engine(families[family])
    want, want_sampled = greedy(plain), sampled(plain)
    # The draft model: another Qwen2 checkpoint over the same tokenizer.
    draft = {"ngram": None, "draft-model": families["qwen2-untied"]}.get(drafter)
    draft = draft or drafter_checkpoints.get((family, drafter))
    e = make_engine(families[family], drafter=drafter, draft_model=draft)
    assert greedy(e) == want
    if drafter != "draft-model":  # its sampled drafts are chains drawn from q: the law is kept, not the draws
        assert sampled(e) == want_sampled
    stats = e.stats()
    assert stats.spec.num_draft_tokens > 0 and stats.kv_free_blocks == 96


@needs_fused
@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["ngram", "lyanna"])
def test_speculation_is_lossless_on_the_fused_decoder(families, drafter_checkpoints, drafter):
    """The served CPU configuration for a Qwen2 target: bf16, int4 weights, the fused decoder (and the
    drafter's fused layer)."""
    settings = {"dtype": "bfloat16", "quantization": "int4"}
    plain = make_engine(families["qwen2"], **settings)
    assert plain.model.fused_decoder(plain.kv_cache, 1) is not None
    want = greedy(plain)
    e = make_engine(
        families["qwen2"], drafter=drafter, draft_model=drafter_checkpoints.get(("qwen2", drafter)), **settings
    )
    if drafter == "lyanna":
        assert e.executor.drafter.fused_layer is not None
    assert greedy(e) == want
    assert e.stats().spec.num_accepted_tokens > 0 or drafter == "lyanna"


# ---- tensor parallel: two ranks compute the single rank's logits ---------------------------------------------------
def tp_worker(rank: int, world: int, folders: dict[str, str], out_dir: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        tp = TensorParallel(world_size=world, rank=rank, group=dist.group.WORLD)
        for name, folder in folders.items():
            quant = "int4" if name.endswith("int4") else "none"
            model = load_model(folder, dtype="float32", tp=tp, quantization=quant).model
            assert model.attn_kv_heads == 1  # each rank holds one of the 2 KV heads (and its q/k/v biases)
            logits = prompt_and_steps(model, list(range(500, 531)), [3, 4])
            torch.save(logits, os.path.join(out_dir, f"{name}-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_tensor_parallel_ranks_compute_the_single_rank_logits(families, tmp_path):
    folders = {"qwen2": families["qwen2"], "qwen2-int4": families["qwen2-untied"], "mistral": families["mistral"]}
    port = 29500 + (os.getpid() + 500) % 1000
    mp.spawn(tp_worker, args=(2, folders, str(tmp_path), port), nprocs=2, join=True)
    for name, folder in folders.items():
        quant = "int4" if name.endswith("int4") else "none"
        want = prompt_and_steps(
            load_model(folder, dtype="float32", quantization=quant).model, list(range(500, 531)), [3, 4]
        )
        for rank in range(2):
            torch.testing.assert_close(torch.load(tmp_path / f"{name}-rank{rank}.pt"), want, rtol=1e-5, atol=1e-5)


def test_a_hidden_state_drafter_without_a_checkpoint_for_the_target_says_how_to_get_one(families):
    for kind in ("lyanna", "eagle"):
        with pytest.raises(ValueError, match=rf"python -m engines.training --kind {kind} --model .*qwen2"):
            make_engine(families["qwen2"], drafter=kind)


# ---- a drafter trained by `python -m engines.training` for a Qwen2 target -----------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lyanna", "eagle"])
def test_training_produces_a_drafter_the_engine_serves_losslessly(families, tmp_path, kind):
    from engines.training.pipeline import main

    out = tmp_path / "run"
    final = main([
        "--kind", kind, "--model", families["qwen2"], "--source", "sharegpt", "--num", "4", "--val-num", "2",
        "--max-seq", "64", "--draft-vocab", "256", "--batch-seqs", "2", "--eval-every", "2",
        "--features", "on-the-fly", "--out", str(out),
    ])  # fmt: skip
    assert final["step"] >= 1 and final["val_loss"] > 0
    checkpoint = out / "checkpoint"
    assert json.loads((checkpoint / "config.json").read_text())["kind"] == kind
    want = greedy(make_engine(families["qwen2"]))
    e = make_engine(families["qwen2"], drafter=kind, draft_model=str(checkpoint))
    assert greedy(e) == want
    assert e.stats().spec.num_draft_tokens > 0


@pytest.mark.slow
def test_a_tensor_parallel_engine_speculates_losslessly_on_qwen2(families):
    """Rank 0 here, rank 1 a Ray actor: a Qwen2 target split over two ranks, with n-gram speculation, gives
    the single rank's plain greedy outputs."""
    import ray

    want = greedy(make_engine(families["qwen2"]))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        e = make_engine(families["qwen2"], tensor_parallel_size=2, drafter="ngram")
        try:
            # rank 0's half: 2 query heads, 1 key and 1 value head of 16, and their biases
            assert e.model.attn_kv_heads == 1 and e.model.layers[0].attn.qkv_proj.bias.shape == (64,)
            assert greedy(e) == want
            assert e.stats().spec.num_accepted_tokens > 0
        finally:
            e.shutdown()
    finally:
        ray.shutdown()
