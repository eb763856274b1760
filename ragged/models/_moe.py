"""Mixture-of-experts decoders the runtimes train: their config, presets and tensor shapes.

An MoE decoder here is the llama (embedding, GQA attention with RoPE, RMSNorm, untied head) whose
feed-forward is a routed mixture of SwiGLU experts. ``MoeConfig`` names the choices real models make:

- scoring: ``softmax`` (Mixtral, GPT-OSS: softmax over the experts, the top-k renormalised, which equals a
  softmax over the top-k logits) or ``sigmoid`` (DeepSeek-V3: sigmoid scores, the top-k renormalised and
  scaled by ``routed_scale``; its bias-corrected, aux-loss-free selection is not modelled);
- storage: ``modules`` (one SwiGLU module per expert, ``experts.{e}.w1/w2/w3``: Mixtral, DeepSeek-V3) or
  ``fused`` (GPT-OSS: ``experts.gate_up_proj [E, dim, 2 f]`` with gate and up interleaved along the last
  dim, ``down_proj [E, f, dim]``, both with biases, and a router bias);
- a shared expert every token goes through (DeepSeek-V3) and dense feed-forward first layers.

The load-balancing loss is Switch's: ``E * sum_e f_e P_e`` with ``f_e`` the share of the ``tokens x top_k``
assignments that went to expert ``e`` and ``P_e`` its mean routing probability (1 when balanced).

``moe_shapes`` lists the tensors under the FQNs the torch and flax ``MoE`` models use, in their
``named_parameters`` order; the full-size presets count every expert tensor, so the memory plan and
``--dry-run`` see the real sizes. The ``*-tiny`` presets keep each model's structure at CPU size.
"""

from __future__ import annotations

from dataclasses import dataclass

from ragged._errors import RaggedError
from ragged._units import ModelShapes, UnitShapes
from ragged.models._presets import LlamaConfig, _embedding_and_output, _llama_attention

SCORINGS = ("softmax", "sigmoid")
STORAGES = ("modules", "fused")


@dataclass(frozen=True)
class MoeConfig:
    """A llama whose feed-forward (after ``n_dense_layers`` dense ones) is a mixture of experts.

    The attention fields have the llama's names, so the llama's attention reads this config as is.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    expert_dim: int  # f: the hidden width of one expert
    experts: str = "modules"  # one of STORAGES
    scoring: str = "softmax"  # one of SCORINGS
    router_bias: bool = False
    shared_expert_dim: int = 0  # 0: no shared expert
    routed_scale: float = 1.0  # the routed experts' output scale (DeepSeek-V3: 2.5)
    n_dense_layers: int = 0
    dense_ffn_dim: int = 0
    aux_loss_coef: float = 0.01
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0

    def __post_init__(self) -> None:
        if self.experts not in STORAGES:
            raise RaggedError(f"MoeConfig.experts={self.experts!r}: expert storage is one of {STORAGES}")
        if self.scoring not in SCORINGS:
            raise RaggedError(f"MoeConfig.scoring={self.scoring!r}: router scoring is one of {SCORINGS}")
        if not 1 <= self.top_k <= self.n_experts:
            raise RaggedError(f"MoeConfig.top_k={self.top_k}: must be between 1 and n_experts="
                              f"{self.n_experts}")
        if not 0 <= self.n_dense_layers < self.n_layers or (self.n_dense_layers and self.dense_ffn_dim < 1):
            raise RaggedError(f"MoeConfig: n_dense_layers={self.n_dense_layers} must be below n_layers="
                              f"{self.n_layers}, with dense_ffn_dim > 0 when there are any")

    def llama(self, ffn_dim: int) -> LlamaConfig:
        """The llama with this model's embedding, attention and norms and a dense FFN ``ffn_dim`` wide.

        Its ``FeedForward`` is one expert (``ffn_dim = expert_dim``), the shared expert or a dense layer.
        """
        return LlamaConfig(self.vocab_size, self.dim, self.n_layers, self.n_heads, self.n_kv_heads,
                           self.head_dim, ffn_dim, self.norm_eps, self.rope_theta)

    @property
    def active_ffn_dim(self) -> int:
        """The FFN width one token goes through in an MoE layer: ``top_k`` experts and the shared one."""
        return self.top_k * self.expert_dim + self.shared_expert_dim

    def is_moe(self, layer: int) -> bool:
        return layer >= self.n_dense_layers


def _swiglu(p: str, dim: int, ffn: int) -> list:
    return [(f"{p}.w1.weight", (ffn, dim)), (f"{p}.w2.weight", (dim, ffn)), (f"{p}.w3.weight", (ffn, dim))]


def expert_shapes(q: str, c: MoeConfig, n_experts: int) -> list:
    """The tensors of ``n_experts`` routed experts stored as ``c`` stores them, under prefix ``q`` (an MoE's
    ``experts``): all of a layer's, or one EP rank's share (``ragged.models.plan_expert_parallel``)."""
    d, f = c.dim, c.expert_dim
    if c.experts == "fused":
        return [(f"{q}.gate_up_proj", (n_experts, d, 2 * f)), (f"{q}.gate_up_proj_bias", (n_experts, 2 * f)),
                (f"{q}.down_proj", (n_experts, f, d)), (f"{q}.down_proj_bias", (n_experts, d))]
    return [t for i in range(n_experts) for t in _swiglu(f"{q}.{i}", d, f)]


def moe_ffn_shapes(p: str, c: MoeConfig) -> list:
    """The tensors of one MoE feed-forward under prefix ``p``, in the models' order."""
    e, d = c.n_experts, c.dim
    tensors = [(f"{p}.router.weight", (e, d))] + ([(f"{p}.router.bias", (e,))] if c.router_bias else [])
    tensors += expert_shapes(f"{p}.experts", c, e)
    if c.shared_expert_dim:
        tensors += _swiglu(f"{p}.shared_expert", d, c.shared_expert_dim)
    return tensors


def moe_shapes(name: str, c: MoeConfig) -> ModelShapes:
    """The units of MoE decoder ``c``: embedding, one per layer, then final norm and head."""
    layers = []
    for i in range(c.n_layers):
        p = f"layers.{i}"
        ffn = moe_ffn_shapes(f"{p}.feed_forward", c) if c.is_moe(i) else \
            _swiglu(f"{p}.feed_forward", c.dim, c.dense_ffn_dim)
        layers.append(UnitShapes(p, tuple(
            _llama_attention(p, c.dim, c.n_heads, c.n_kv_heads, c.head_dim) + ffn + [
                (f"{p}.attention_norm.weight", (c.dim,)), (f"{p}.ffn_norm.weight", (c.dim,))])))
    return ModelShapes(name, _embedding_and_output(c.vocab_size, c.dim, layers))


# The public configs with the llama's attention in place of GPT-OSS's sinks and biases and DeepSeek-V3's
# MLA (so attention sizes differ a little from ``model_shapes``'s presets; every expert tensor is there).
MOE_CONFIGS = {
    "mixtral-8x7b": MoeConfig(32000, 4096, 32, 32, 8, 128, n_experts=8, top_k=2, expert_dim=14336,
                              aux_loss_coef=0.02, rope_theta=1e6),
    "gpt-oss-120b": MoeConfig(201088, 2880, 36, 64, 8, 64, n_experts=128, top_k=4, expert_dim=2880,
                              experts="fused", router_bias=True, rope_theta=150000.0),
    "deepseek-v3": MoeConfig(129280, 7168, 61, 128, 128, 128, n_experts=256, top_k=8, expert_dim=2048,
                             scoring="sigmoid", shared_expert_dim=2048, routed_scale=2.5, n_dense_layers=3,
                             dense_ffn_dim=18432, aux_loss_coef=0.0001, rope_theta=10000.0),
    # CPU-sized, each with its model's structure: routing, storage, shared expert, dense first layers.
    "mixtral-tiny": MoeConfig(256, 64, 2, 4, 2, 16, n_experts=8, top_k=2, expert_dim=96, aux_loss_coef=0.02),
    "gpt-oss-tiny": MoeConfig(256, 64, 2, 4, 2, 16, n_experts=8, top_k=4, expert_dim=48, experts="fused",
                              router_bias=True),
    "deepseek-v3-tiny": MoeConfig(256, 64, 3, 4, 4, 16, n_experts=16, top_k=4, expert_dim=32,
                                  scoring="sigmoid", shared_expert_dim=32, routed_scale=2.5, n_dense_layers=1,
                                  dense_ffn_dim=128),
}
