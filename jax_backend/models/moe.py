"""Mixture-of-experts decoders in flax NNX, with the same class and parameter names as the torch model.

Read it top to bottom: Router (softmax or sigmoid top-k), the load-balancing loss, the two ways real models
store experts (ExpertList: one SwiGLU module per expert, as Mixtral and DeepSeek-V3; FusedExperts: 3-D
tensors with biases, as GPT-OSS), MoE (router, experts, shared expert), TransformerBlock, MoE decoder.
The attention, norms and SwiGLU are the llama's (``llama.py``); ``ragged.models.MoeConfig`` says what
each option means and ``ragged.models.moe_shapes`` lists the parameters under these paths.

Both expert modules map ``(E, C, dim)`` to ``(E, C, dim)``: each expert on its own rows. Here tokens reach
their experts by dense dispatch: every expert runs on every token (its rows are all ``N`` tokens) and a
one-hot combine matrix (zero where a token did not choose the expert) sums the chosen outputs. No shape
depends on the routing, so it jits once, and the values and gradients equal the torch model's gather /
``index_add`` loop (an expert a token did not choose contributes an exact zero). It costs ``E / top_k``
times the routed FLOPs: the dispatch for correctness at CPU sizes, not for speed. No parallelism code
lives here (expert parallelism sends each expert only its tokens: ``expert_parallel.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_backend.models.llama import (
    Attention,
    Embedding,
    FeedForward,
    Linear,
    RMSNorm,
    at_least_fp32,
    cross_entropy,
)
from ragged.models import MOE_CONFIGS, MoeConfig


class Router(nnx.Module):
    """Token -> its ``top_k`` experts and their weights, plus every expert's routing probability."""

    def __init__(self, c: MoeConfig, *, rngs: nnx.Rngs):
        self.scoring, self.top_k, self.routed_scale = c.scoring, c.top_k, c.routed_scale
        self.weight = nnx.Param(0.02 * jax.random.normal(rngs.params(), (c.n_experts, c.dim)))
        self.bias = nnx.Param(jnp.zeros((c.n_experts,))) if c.router_bias else None

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x: (N, dim) -> weights (N, k) fp32, experts (N, k) int32, probs (N, E) fp32."""
        logits = x @ self.weight[...].T
        if self.bias is not None:
            logits = logits + self.bias[...]
        logits = at_least_fp32(logits)  # (N, E)
        scores = jax.nn.softmax(logits, axis=-1) if self.scoring == "softmax" else jax.nn.sigmoid(logits)
        top, experts = jax.lax.top_k(scores, self.top_k)  # (N, k), largest first
        weights = top / jnp.sum(top, axis=-1, keepdims=True) * self.routed_scale
        return weights, experts, scores / jnp.sum(scores, axis=-1, keepdims=True)


def load_balancing_loss(probs: jax.Array, experts: jax.Array) -> jax.Array:
    """Switch's auxiliary loss ``E * sum_e f_e P_e``: 1 when routing is balanced, up to E when collapsed.

    probs: (N, E); experts: (N, k). ``f_e`` (the share of the N k assignments that went to ``e``) counts
    choices and carries no gradient; ``P_e`` (the mean probability) does.
    """
    n_experts = probs.shape[-1]
    share = jnp.sum(jax.nn.one_hot(experts, n_experts, dtype=jnp.float32), axis=(0, 1)) / experts.size  # (E,)
    return n_experts * jnp.sum(share * jnp.mean(probs, axis=0))


def route_tokens(expert_outputs: jax.Array, weights: jax.Array, chosen: jax.Array) -> jax.Array:
    """``sum_k weights[n, k] expert_{chosen[n, k]}(x[n])`` from every expert's output on every token.

    expert_outputs: (E, N, dim); weights, chosen: (N, k) -> (N, dim).
    """
    n_experts = expert_outputs.shape[0]
    one_hot = jax.nn.one_hot(chosen, n_experts, dtype=weights.dtype)  # (N, k, E)
    combine = jnp.einsum("nk,nke->ne", weights, one_hot)  # (N, E): zero where a token did not choose e
    return jnp.einsum("ne,end->nd", combine.astype(expert_outputs.dtype), expert_outputs)


class ExpertList(nnx.List):
    """One SwiGLU ``FeedForward`` per expert: ``experts.{e}.w1/w2/w3`` (Mixtral, DeepSeek-V3)."""

    def __init__(self, c: MoeConfig, *, rngs: nnx.Rngs):
        super().__init__([FeedForward(c.llama(c.expert_dim), rngs=rngs) for _ in range(c.n_experts)])

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: (E, C, dim), expert e's rows x[e] -> (E, C, dim)."""
        return jnp.stack([expert(rows) for expert, rows in zip(self, x, strict=True)])


class FusedExperts(nnx.Module):
    """All experts in 3-D tensors with biases (GPT-OSS): ``gate_up_proj`` (E, dim, 2f) holds gate and up
    interleaved along its last dim, ``down_proj`` (E, f, dim); weights are ``[in, out]`` per expert."""

    def __init__(self, c: MoeConfig, *, rngs: nnx.Rngs):
        e, d, f = c.n_experts, c.dim, c.expert_dim
        self.gate_up_proj = nnx.Param(0.02 * jax.random.normal(rngs.params(), (e, d, 2 * f)))
        self.gate_up_proj_bias = nnx.Param(jnp.zeros((e, 2 * f)))
        self.down_proj = nnx.Param(0.02 * jax.random.normal(rngs.params(), (e, f, d)))
        self.down_proj_bias = nnx.Param(jnp.zeros((e, d)))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: (E, C, dim), expert e's rows x[e] -> (E, C, dim)."""
        h = jnp.einsum("ecd,edf->ecf", x, self.gate_up_proj[...]) + self.gate_up_proj_bias[...][:, None]
        gate, up = h[..., ::2], h[..., 1::2]  # (E, C, f) each
        y = jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, self.down_proj[...])
        return y + self.down_proj_bias[...][:, None]


class MoE(nnx.Module):
    """Router, routed experts and an optional shared expert: (B, T, dim) -> (B, T, dim) and the aux loss."""

    def __init__(self, c: MoeConfig, *, rngs: nnx.Rngs):
        self.router = Router(c, rngs=rngs)
        self.experts = FusedExperts(c, rngs=rngs) if c.experts == "fused" else ExpertList(c, rngs=rngs)
        self.shared_expert = (FeedForward(c.llama(c.shared_expert_dim), rngs=rngs) if c.shared_expert_dim
                              else None)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)  # (N, dim)
        weights, chosen, probs = self.router(tokens)
        every_token = jnp.broadcast_to(tokens, (probs.shape[-1], b * t, d))  # (E, N, dim)
        out = route_tokens(self.experts(every_token), weights, chosen)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        return out.reshape(b, t, d), load_balancing_loss(probs, chosen)


class TransformerBlock(nnx.Module):
    """The llama's pre-norm block with an MoE (or, in the first layers, a dense) feed-forward.

    Returns the block's output and its load-balancing loss (zero for a dense layer).
    """

    def __init__(self, c: MoeConfig, moe: bool, *, rngs: nnx.Rngs):
        self.attention = Attention(c, rngs=rngs)  # MoeConfig has the llama's attention fields
        self.feed_forward = MoE(c, rngs=rngs) if moe else FeedForward(c.llama(c.dense_ffn_dim), rngs=rngs)
        self.attention_norm = RMSNorm(c.dim, c.norm_eps)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = x + self.attention(self.attention_norm(x))
        if isinstance(self.feed_forward, FeedForward):  # dense; else an MoE (or its expert-parallel form)
            out, aux = self.feed_forward(self.ffn_norm(h)), jnp.zeros((), jnp.float32)
        else:
            out, aux = self.feed_forward(self.ffn_norm(h))
        return h + out, aux


class MoEDecoder(nnx.Module):
    """Token ids (B, T) -> logits (B, T, vocab) and the mean load-balancing loss of the MoE layers."""

    def __init__(self, c: MoeConfig = MOE_CONFIGS["mixtral-tiny"], *, rngs: nnx.Rngs):
        self.config = c
        self.tok_embeddings = Embedding(c.vocab_size, c.dim, rngs=rngs)
        self.layers = nnx.List([TransformerBlock(c, c.is_moe(i), rngs=rngs) for i in range(c.n_layers)])
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.output = Linear(c.dim, c.vocab_size, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = self.tok_embeddings(tokens)  # (B, T, dim)
        aux = []
        for layer in self.layers:
            h, layer_aux = layer(h)
            aux.append(layer_aux)
        n_moe = self.config.n_layers - self.config.n_dense_layers
        return self.output(self.norm(h)), jnp.sum(jnp.stack(aux)) / n_moe


def moe_loss(output: tuple[jax.Array, jax.Array], targets: jax.Array, aux_loss_coef: float) -> jax.Array:
    """Next-token cross entropy plus ``aux_loss_coef`` times the load-balancing loss (fp32)."""
    logits, aux = output
    return cross_entropy(logits, targets) + aux_loss_coef * aux
