"""llama-tiny in PyTorch: a LLaMA-3-style decoder with the same class and parameter names as the flax model.

Read it top to bottom: RMSNorm, RoPE, Attention (GQA, causal), FeedForward (SwiGLU), TransformerBlock,
Llama. Weights are ``[out, in]`` (``nn.Linear``) and the parameter names (``layers.0.attention.wq.weight``,
...) are the FQNs of ``ragged.models.model_shapes("llama-tiny")``, in the preset's order inside each layer. No
parallelism code lives here: ``parallelize.py`` applies ``fully_shard``. The model can be built on the
meta device; ``init_weights(seed)`` then gives every parameter the same values as a model built on CPU.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ragged.models import LLAMA_TINY, LlamaConfig
from torch_backend._torch_internals import loss_parallel_active


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, or in its own dtype if wider: bf16 models normalise and score in fp32, and a float64
    model (the parity tests') stays float64 throughout."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``; the statistics are taken in fp32 even when ``x`` is bf16."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = at_least_fp32(x)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def apply_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate consecutive pairs ``(x[2i], x[2i+1])`` by position-dependent angles (Meta's layout).

    x: (B, T, H, D) -> (B, T, H, D); the angles are computed in fp32 (float64 for a float64 ``x``) from
    the shapes, so there is no buffer to materialise after building on the meta device.
    """
    _, t, _, d = x.shape
    pairs = at_least_fp32(x).reshape(*x.shape[:-1], d // 2, 2)
    freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=pairs.dtype, device=x.device) / d)  # (D/2,)
    angles = torch.arange(t, dtype=pairs.dtype, device=x.device)[:, None] * freqs[None, :]  # (T, D/2)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    re, im = pairs[..., 0], pairs[..., 1]
    out = torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1)
    return out.reshape(x.shape).to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention: ``n_heads`` query heads share ``n_kv_heads`` key/value heads."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.theta = c.rope_theta
        self.wq = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Head counts come from the projections' widths (-1), as in torchtitan: under tensor parallelism
        # (``tensor_parallel.py``) each rank computes only its heads.
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head_dim)  # (B, T, H, D)
        k = self.wk(x).view(b, t, -1, self.head_dim)  # (B, T, KV, D)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        q, k = apply_rope(q, self.theta), apply_rope(k, self.theta)
        repeat = self.n_heads // self.n_kv_heads  # each kv head serves `repeat` query heads
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)  # (B, T, H, D)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (B, H, T, D)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.w2 = nn.Linear(c.ffn_dim, c.dim, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention, then the feed-forward network.

    The norms are registered after the layers they feed so that ``named_parameters()`` follows the
    preset order (wq wk wv wo, w1 w2 w3, attention_norm, ffn_norm), which the planner keeps.
    """

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.attention = Attention(c)
        self.feed_forward = FeedForward(c)
        self.attention_norm = RMSNorm(c.dim, c.norm_eps)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab); the head is not tied to the embedding."""

    def __init__(self, c: LlamaConfig = LLAMA_TINY) -> None:
        super().__init__()
        self.config = c
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList([TransformerBlock(c) for _ in range(c.n_layers)])
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.output = nn.Linear(c.dim, c.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)  # (B, T, dim)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))  # (B, T, vocab)

    def init_weights(self, seed: int = 0, only: Collection[str] | None = None) -> None:
        """Give every parameter its initial value (``init_parameters``)."""
        init_parameters(self, seed, only)


class OneProcessPlace(NamedTuple):
    """Where a parameter of a model that holds part of a larger one (expert parallelism) sits in the
    one-process model: its position in ``named_parameters()`` order, and for a slice of a larger tensor
    the rows ``[lo, hi)`` it holds of that tensor's ``shape``."""

    index: int
    lo: int | None = None
    hi: int | None = None
    shape: tuple[int, ...] | None = None


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int = 0, only: Collection[str] | None = None,
                    places: Mapping[str, OneProcessPlace] | None = None) -> None:
    """Give every parameter its initial value: a function of ``seed`` and its position only.

    Parameter ``i`` (in ``named_parameters()`` order) is drawn on CPU from its own generator seeded
    with ``(seed, i)``: matrices and biases ~ N(0, 0.02^2), the embedding ~ N(0, 1), norms = 1. Because no
    value depends on the device or on other parameters, a model built on the meta device and
    sharded first gets exactly the values of a model built in one process. ``only`` (FQNs) limits
    it to some parameters with unchanged values, e.g. one unsharded FSDP unit at a time. A parameter that
    tensor parallelism made a DTensor gets its part of the same value. ``places`` (by FQN): the position
    each parameter has in the one-process model, when this model holds part of it (an EP rank's experts).
    """
    for i, (name, p) in enumerate(model.named_parameters()):
        if only is not None and name not in only:
            continue
        place = OneProcessPlace(i) if places is None else places[name]
        g = torch.Generator().manual_seed(seed * 1_000_003 + place.index)
        shape = p.shape if place.shape is None else place.shape
        if name.endswith("norm.weight"):
            value = torch.ones(shape)
        else:
            std = 1.0 if name.startswith("tok_embeddings") else 0.02
            value = torch.randn(shape, generator=g) * std
        if place.lo is not None:  # rows of a larger tensor (a fused experts slice)
            value = value[place.lo:place.hi]
        if isinstance(p, DTensor):  # split by tensor parallelism: this rank's part, cut locally
            value = distribute_tensor(value.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
        p.copy_(value)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, computed in fp32 (or in the logits' dtype, if wider), as a plain
    scalar tensor.

    ``logits`` split by vocabulary over a TP mesh (a DTensor ``Shard(-1)``, ``apply_tensor_parallel``'s
    loss parallelism) give the same loss on every TP rank; call this and ``backward`` under
    ``torch.distributed.tensor.parallel.loss_parallel()``, which computes it on the parts.

    Raises:
        ValueError: DTensor ``logits`` outside ``loss_parallel()``.
    """
    if isinstance(logits, DTensor) and not loss_parallel_active():
        raise ValueError(
            f"cross_entropy: the logits are a DTensor {tuple(logits.placements)} on mesh "
            f"{tuple(logits.device_mesh.shape)} (split by vocabulary: apply_tensor_parallel's loss_parallel="
            "True); compute the loss and call backward under torch.distributed.tensor.parallel."
            "loss_parallel(), or build the model with loss_parallel=False")
    loss = F.cross_entropy(at_least_fp32(logits).flatten(0, 1), targets.flatten())
    return loss.to_local() if isinstance(loss, DTensor) else loss  # replicated: every TP rank's value
