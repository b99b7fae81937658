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
import shutil
from pathlib import Path

import pytest
import torch

from engines.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError
from engines.engine import EngineConfig, LLMEngine
from engines.errors import ContextLengthError
from engines.loader import load_model, resolve_checkpoint
from engines.sampling import SamplingParams
from tests.engines.helpers import forward_one, new_cache

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
