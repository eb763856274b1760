"""Model presets against the published parameter counts and the shapes in MODEL_SHAPES.md."""

import math

import pytest

from ragged import RaggedError
from ragged.models import LLAMA_TINY, model_names, model_shapes

# Published totals: Meta's Llama 3 / 3.1 model cards (8.03B, 70.55B, 405.85B), Mistral's Mixtral
# 8x7B (46.70B), OpenAI's gpt-oss-120b model card (116.83B), DeepSeek-V3 without the MTP module
# (671.03B; 685B with it).
PUBLISHED = {
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
    "mixtral-8x7b": 46_702_792_704,
    "gpt-oss-120b": 116_829_156_672,
    "deepseek-v3": 671_026_419_200,
}


def _llama_count(v, h, layers, q_heads, kv_heads, head_dim, ffn):
    attention = 2 * q_heads * head_dim * h + 2 * kv_heads * head_dim * h
    return 2 * v * h + h + layers * (attention + 3 * ffn * h + 2 * h)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_published(name):
    assert model_shapes(name).numel == PUBLISHED[name]


def test_llama_tiny_closed_form_and_fqns():
    c = LLAMA_TINY
    ms = model_shapes("llama-tiny")
    assert ms.numel == _llama_count(c.vocab_size, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim,
                                    c.ffn_dim)
    assert [u.name for u in ms.units] == ["tok_embeddings", *[f"layers.{i}" for i in range(4)], "output"]
    layer = [n for n, _ in ms.units[1].tensors]
    assert layer == [f"layers.0.{s}.weight" for s in (
        "attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
        "feed_forward.w2", "feed_forward.w3", "attention_norm", "ffn_norm")]
    assert ms.units[-1].tensors == (("norm.weight", (64,)), ("output.weight", (256, 64)))


@pytest.mark.parametrize("name, layers", [("llama3-8b", 32), ("llama3-70b", 80), ("llama3-405b", 126),
                                          ("mixtral-8x7b", 32), ("gpt-oss-120b", 36), ("deepseek-v3", 61)])
def test_one_unit_per_layer_plus_embedding_and_output(name, layers):
    ms = model_shapes(name)
    assert len(ms.units) == layers + 2
    assert ms.units[0].name == "tok_embeddings" and ms.units[-1].name == "output"
    names = [n for u in ms.units for n, _ in u.tensors]
    assert len(names) == len(set(names))
    assert all(n.startswith(u.name + ".") for u in ms.units[1:-1] for n, _ in u.tensors)


def test_deepseek_v3_structure():
    units = model_shapes("deepseek-v3").units
    dense, moe = dict(units[3].tensors), dict(units[4].tensors)  # layers.2 and layers.3
    assert dense["layers.2.mlp.gate_proj.weight"] == (18432, 7168)
    assert moe["layers.3.mlp.gate.weight"] == (256, 7168)
    assert moe["layers.3.mlp.experts.255.down_proj.weight"] == (7168, 2048)
    assert moe["layers.3.mlp.shared_experts.up_proj.weight"] == (2048, 7168)
    assert "layers.3.mlp.experts.256.up_proj.weight" not in moe
    assert moe["layers.3.self_attn.q_b_proj.weight"] == (128 * (128 + 64), 1536)
    assert moe["layers.3.self_attn.kv_b_proj.weight"] == (128 * (128 + 128), 512)
    assert moe["layers.3.self_attn.kv_a_proj_with_mqa.weight"] == (512 + 64, 7168)
    assert sum(".experts." in n for n in moe) == 256 * 3


def test_gpt_oss_fused_experts_and_mixtral_experts():
    gpt = dict(model_shapes("gpt-oss-120b").units[1].tensors)
    assert gpt["layers.0.mlp.experts.gate_up_proj"] == (128, 2880, 5760)
    assert gpt["layers.0.mlp.experts.down_proj"] == (128, 2880, 2880)
    assert gpt["layers.0.attention.sinks"] == (64,)
    mix = dict(model_shapes("mixtral-8x7b").units[1].tensors)
    assert mix["layers.0.feed_forward.gate.weight"] == (8, 4096)
    assert sum(".experts." in n for n in mix) == 8 * 3
    assert math.prod(mix["layers.0.feed_forward.experts.7.w2.weight"]) == 4096 * 14336


def test_model_names_and_unknown_model():
    assert set(PUBLISHED) | {"llama-tiny"} == set(model_names())
    with pytest.raises(RaggedError, match="unknown model 'llama3-7b'.*known models: llama-tiny"):
        model_shapes("llama3-7b")
