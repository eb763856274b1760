"""llama-tiny in flax NNX: a LLaMA-3-style decoder with the same class and parameter names as the torch model.

Read it top to bottom: Linear, Embedding, RMSNorm, RoPE, Attention (GQA, causal), FeedForward (SwiGLU),
TransformerBlock, Llama. Weights are stored ``[out, in]`` like ``torch.nn.Linear`` and the parameter paths
(``layers.0.attention.wq.weight``, ...) are the FQNs of ``ragged.models.model_shapes("llama-tiny")``, so a
name in a ``Layout`` or a checkpoint means the same tensor on both stacks. No parallelism code lives here: the
model computes in the dtype of its parameters, and ``parallelize.py`` decides where they come from.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ragged.models import LLAMA_TINY, LlamaConfig


class Linear(nnx.Module):
    """``y = x @ weight.T`` with ``weight`` of shape ``[out, in]`` (the torch convention), no bias."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs, std: float = 0.02):
        self.weight = nnx.Param(std * jax.random.normal(rngs.params(), (out_features, in_features)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.weight[...].T


class Embedding(nnx.Module):
    """Token embedding table ``weight`` of shape ``[vocab, dim]``."""

    def __init__(self, vocab_size: int, dim: int, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (vocab_size, dim)))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.weight[...][tokens]


def at_least_fp32(x: jax.Array) -> jax.Array:
    """``x`` in fp32, or in its own dtype where that is wider (float64): statistics taken "in fp32" for bf16
    never round a float64 model's values down to fp32."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


class RMSNorm(nnx.Module):
    """``x / rms(x) * weight``; the statistics are taken in fp32 even when ``x`` is bf16."""

    def __init__(self, dim: int, eps: float):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,)))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = at_least_fp32(x)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return normed.astype(x.dtype) * self.weight[...]


def apply_rope(x: jax.Array, theta: float) -> jax.Array:
    """Rotate consecutive pairs ``(x[2i], x[2i+1])`` by position-dependent angles (Meta's layout).

    x: (B, T, H, D) -> (B, T, H, D); the angles are computed in fp32 (float64 for a float64 ``x``, as
    torch_backend's) from static shapes.
    """
    _, t, _, d = x.shape
    pairs = at_least_fp32(x).reshape(*x.shape[:-1], d // 2, 2)
    freqs = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=pairs.dtype) / d)  # (D/2,)
    angles = jnp.arange(t, dtype=pairs.dtype)[:, None] * freqs[None, :]  # (T, D/2)
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    re, im = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


class Attention(nnx.Module):
    """Causal grouped-query attention: ``n_heads`` query heads share ``n_kv_heads`` key/value heads."""

    def __init__(self, c: LlamaConfig, *, rngs: nnx.Rngs):
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.theta = c.rope_theta
        self.wq = Linear(c.dim, c.n_heads * c.head_dim, rngs=rngs)
        self.wk = Linear(c.dim, c.n_kv_heads * c.head_dim, rngs=rngs)
        self.wv = Linear(c.dim, c.n_kv_heads * c.head_dim, rngs=rngs)
        self.wo = Linear(c.n_heads * c.head_dim, c.dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        q = self.wq(x).reshape(b, t, self.n_heads, self.head_dim)  # (B, T, H, D)
        k = self.wk(x).reshape(b, t, self.n_kv_heads, self.head_dim)  # (B, T, KV, D)
        v = self.wv(x).reshape(b, t, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, self.theta), apply_rope(k, self.theta)
        repeat = self.n_heads // self.n_kv_heads  # each kv head serves `repeat` query heads
        k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)  # (B, T, H, D)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(self.head_dim).astype(q.dtype)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(causal, at_least_fp32(scores), -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # (B, H, T, T)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, self.n_heads * self.head_dim)
        return self.wo(out)


class FeedForward(nnx.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, c: LlamaConfig, *, rngs: nnx.Rngs):
        self.w1 = Linear(c.dim, c.ffn_dim, rngs=rngs)
        self.w2 = Linear(c.ffn_dim, c.dim, rngs=rngs)
        self.w3 = Linear(c.dim, c.ffn_dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.w2(jax.nn.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nnx.Module):
    """Pre-norm residual block: attention, then the feed-forward network."""

    def __init__(self, c: LlamaConfig, *, rngs: nnx.Rngs):
        self.attention = Attention(c, rngs=rngs)
        self.feed_forward = FeedForward(c, rngs=rngs)
        self.attention_norm = RMSNorm(c.dim, c.norm_eps)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nnx.Module):
    """Token ids (B, T) -> logits (B, T, vocab); the head is not tied to the embedding."""

    def __init__(self, c: LlamaConfig = LLAMA_TINY, *, rngs: nnx.Rngs):
        self.config = c
        self.tok_embeddings = Embedding(c.vocab_size, c.dim, rngs=rngs)
        self.layers = nnx.List([TransformerBlock(c, rngs=rngs) for _ in range(c.n_layers)])
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.output = Linear(c.dim, c.vocab_size, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = self.tok_embeddings(tokens)  # (B, T, dim)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))  # (B, T, vocab)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross entropy, computed in fp32."""
    logp = jax.nn.log_softmax(at_least_fp32(logits), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
