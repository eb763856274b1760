"""Model shape presets from the public configurations (see MODEL_SHAPES.md in the docs).

One FSDP unit per decoder layer, plus an embedding unit and an output unit (final norm + head).
Weights are ``[out, in]`` like ``nn.Linear``. Tensor names are the FQNs that the torch and flax
``llama-tiny`` models use, so a name in a ``Layout`` means the same tensor on both stacks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ragged._errors import RaggedError
from ragged._units import ModelShapes, UnitShapes


@dataclass(frozen=True)
class LlamaConfig:
    """A LLaMA-3-style decoder; ``llama-tiny`` is the one the runtimes train."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0


LLAMA_TINY = LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                         ffn_dim=176)

LLAMA_CONFIGS = {
    "llama-tiny": LLAMA_TINY,
    "llama3-8b": LlamaConfig(128256, 4096, 32, 32, 8, 128, 14336),
    "llama3-70b": LlamaConfig(128256, 8192, 80, 64, 8, 128, 28672),
    "llama3-405b": LlamaConfig(128256, 16384, 126, 128, 8, 128, 53248),
}


def _llama_attention(p: str, h: int, q_heads: int, kv_heads: int, head_dim: int) -> list:
    return [
        (f"{p}.attention.wq.weight", (q_heads * head_dim, h)),
        (f"{p}.attention.wk.weight", (kv_heads * head_dim, h)),
        (f"{p}.attention.wv.weight", (kv_heads * head_dim, h)),
        (f"{p}.attention.wo.weight", (h, q_heads * head_dim)),
    ]


def _embedding_and_output(vocab: int, h: int, layers: list[UnitShapes]) -> tuple[UnitShapes, ...]:
    return (
        UnitShapes("tok_embeddings", (("tok_embeddings.weight", (vocab, h)),)),
        *layers,
        UnitShapes("output", (("norm.weight", (h,)), ("output.weight", (vocab, h)))),
    )


def llama_shapes(name: str, c: LlamaConfig) -> ModelShapes:
    """The units of a LLaMA-3-style model with config ``c`` (any size, e.g. a benchmark's own)."""
    layers = []
    for i in range(c.n_layers):
        p = f"layers.{i}"
        layers.append(UnitShapes(p, tuple(
            _llama_attention(p, c.dim, c.n_heads, c.n_kv_heads, c.head_dim) + [
                (f"{p}.feed_forward.w1.weight", (c.ffn_dim, c.dim)),
                (f"{p}.feed_forward.w2.weight", (c.dim, c.ffn_dim)),
                (f"{p}.feed_forward.w3.weight", (c.ffn_dim, c.dim)),
                (f"{p}.attention_norm.weight", (c.dim,)),
                (f"{p}.ffn_norm.weight", (c.dim,)),
            ])))
    return ModelShapes(name, _embedding_and_output(c.vocab_size, c.dim, layers))


def mixtral_8x7b() -> ModelShapes:
    h, f, experts = 4096, 14336, 8
    layers = []
    for i in range(32):
        p = f"layers.{i}"
        tensors = _llama_attention(p, h, 32, 8, 128) + [(f"{p}.feed_forward.gate.weight", (experts, h))]
        for e in range(experts):
            q = f"{p}.feed_forward.experts.{e}"
            tensors += [(f"{q}.w1.weight", (f, h)), (f"{q}.w2.weight", (h, f)), (f"{q}.w3.weight", (f, h))]
        tensors += [(f"{p}.attention_norm.weight", (h,)), (f"{p}.ffn_norm.weight", (h,))]
        layers.append(UnitShapes(p, tuple(tensors)))
    return ModelShapes("mixtral-8x7b", _embedding_and_output(32000, h, layers))


def gpt_oss_120b() -> ModelShapes:
    h, experts, inter, heads, kv, hd = 2880, 128, 2880, 64, 8, 64
    layers = []
    for i in range(36):
        p = f"layers.{i}"
        a, m = f"{p}.attention", f"{p}.mlp"
        layers.append(UnitShapes(p, (
            (f"{a}.q_proj.weight", (heads * hd, h)), (f"{a}.q_proj.bias", (heads * hd,)),
            (f"{a}.k_proj.weight", (kv * hd, h)), (f"{a}.k_proj.bias", (kv * hd,)),
            (f"{a}.v_proj.weight", (kv * hd, h)), (f"{a}.v_proj.bias", (kv * hd,)),
            (f"{a}.o_proj.weight", (h, heads * hd)), (f"{a}.o_proj.bias", (h,)),
            (f"{a}.sinks", (heads,)),
            (f"{m}.router.weight", (experts, h)), (f"{m}.router.bias", (experts,)),
            (f"{m}.experts.gate_up_proj", (experts, h, 2 * inter)),
            (f"{m}.experts.gate_up_proj_bias", (experts, 2 * inter)),
            (f"{m}.experts.down_proj", (experts, inter, h)),
            (f"{m}.experts.down_proj_bias", (experts, h)),
            (f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,)),
        )))
    return ModelShapes("gpt-oss-120b", _embedding_and_output(201088, h, layers))


def deepseek_v3() -> ModelShapes:
    h, n_dense, n_layers, routed, inter, dense_ffn = 7168, 3, 61, 256, 2048, 18432
    layers = []
    for i in range(n_layers):
        p = f"layers.{i}"
        a = f"{p}.self_attn"
        tensors = [
            (f"{a}.q_a_proj.weight", (1536, h)), (f"{a}.q_a_layernorm.weight", (1536,)),
            (f"{a}.q_b_proj.weight", (128 * 192, 1536)),
            (f"{a}.kv_a_proj_with_mqa.weight", (576, h)), (f"{a}.kv_a_layernorm.weight", (512,)),
            (f"{a}.kv_b_proj.weight", (128 * 256, 512)), (f"{a}.o_proj.weight", (h, 128 * 128)),
        ]
        m = f"{p}.mlp"
        if i < n_dense:
            tensors += _ffn(m, h, dense_ffn)
        else:
            tensors += [(f"{m}.gate.weight", (routed, h)), (f"{m}.gate.e_score_correction_bias", (routed,))]
            for e in range(routed):
                tensors += _ffn(f"{m}.experts.{e}", h, inter)
            tensors += _ffn(f"{m}.shared_experts", h, inter)
        tensors += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,))]
        layers.append(UnitShapes(p, tuple(tensors)))
    return ModelShapes("deepseek-v3", _embedding_and_output(129280, h, layers))


def _ffn(p: str, h: int, inter: int) -> list:
    return [(f"{p}.gate_proj.weight", (inter, h)), (f"{p}.up_proj.weight", (inter, h)),
            (f"{p}.down_proj.weight", (h, inter))]


_BUILDERS: dict[str, Callable[[], ModelShapes]] = {
    **{name: (lambda n=name: llama_shapes(n, LLAMA_CONFIGS[n])) for name in LLAMA_CONFIGS},
    "mixtral-8x7b": mixtral_8x7b,
    "gpt-oss-120b": gpt_oss_120b,
    "deepseek-v3": deepseek_v3,
}


def model_names() -> tuple[str, ...]:
    return tuple(_BUILDERS)


def model_shapes(name: str) -> ModelShapes:
    """The preset ``name`` (one of ``model_names()``)."""
    if name not in _BUILDERS:
        raise RaggedError(f"unknown model {name!r}; known models: {', '.join(_BUILDERS)}")
    return _BUILDERS[name]()
