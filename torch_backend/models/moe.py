"""Mixture-of-experts decoders in PyTorch, with the same class and parameter names as the flax model.

Read it top to bottom: Router (softmax or sigmoid top-k), the load-balancing loss, the two ways real models
store experts (ExpertList: one SwiGLU module per expert, as Mixtral and DeepSeek-V3; FusedExperts: 3-D
tensors with biases, as GPT-OSS), MoE (router, experts, shared expert), TransformerBlock, MoE decoder.
The attention, norms and SwiGLU are the llama's (``llama.py``); ``ragged.models.MoeConfig`` says what
each option means and ``ragged.models.moe_shapes`` lists the parameters in ``named_parameters()`` order.

Tokens reach their experts as in HuggingFace's MoE layers: a loop over the experts that got tokens, each
gathering its tokens (cut from one sort by expert), running, and adding its weighted output back with
``index_add``. Which experts run
therefore depends on the data; no parallelism code lives here (``parallelize.py`` applies ``fully_shard``
with each layer's experts inside the layer's unit, which is what makes that safe).
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn

from ragged.models import MOE_CONFIGS, MoeConfig
from torch_backend.models.llama import (
    Attention,
    FeedForward,
    OneProcessPlace,
    RMSNorm,
    at_least_fp32,
    cross_entropy,
    init_parameters,
)


class Router(nn.Module):
    """Token -> its ``top_k`` experts and their weights, plus every expert's routing probability."""

    def __init__(self, c: MoeConfig) -> None:
        super().__init__()
        self.scoring, self.top_k, self.routed_scale = c.scoring, c.top_k, c.routed_scale
        self.weight = nn.Parameter(torch.empty(c.n_experts, c.dim))
        self.bias = nn.Parameter(torch.empty(c.n_experts)) if c.router_bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (N, dim) -> weights (N, k) fp32, experts (N, k) int64, probs (N, E) fp32 (float64 for a
        float64 ``x``).

        softmax: the top-k of the softmax, renormalised (= a softmax over the top-k logits, GPT-OSS's
        form); sigmoid: the top-k sigmoid scores, renormalised and scaled (DeepSeek-V3); ``probs`` (what
        the load-balancing loss averages) sum to 1 per token in both.
        """
        logits = at_least_fp32(F.linear(x, self.weight, self.bias))  # (N, E)
        scores = logits.softmax(-1) if self.scoring == "softmax" else logits.sigmoid()
        top, experts = scores.topk(self.top_k, dim=-1)  # (N, k), largest first
        weights = top / top.sum(-1, keepdim=True) * self.routed_scale
        return weights, experts, scores / scores.sum(-1, keepdim=True)


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Switch's auxiliary loss ``E * sum_e f_e P_e``: 1 when routing is balanced, up to E when collapsed.

    probs: (N, E); experts: (N, k). ``f_e`` (the share of the N k assignments that went to ``e``) counts
    choices and carries no gradient; ``P_e`` (the mean probability) does.
    """
    n_experts = probs.shape[-1]
    share = torch.bincount(experts.flatten(), minlength=n_experts).to(probs.dtype) / experts.numel()  # (E,)
    return n_experts * (share * probs.mean(0)).sum()


def route_tokens(experts: nn.Module, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
                 ) -> torch.Tensor:
    """``sum_k weights[n, k] expert_{chosen[n, k]}(x[n])``, running only the experts that got tokens.

    x: (N, dim); weights, chosen: (N, k) -> (N, dim). ``experts.expert(e, tokens)`` runs expert ``e``.
    The ``N k`` assignments are sorted by expert (stably, so each expert's tokens stay in ascending
    order) and cut at the per-expert counts: reading the counts is the one host sync of the layer (on
    a GPU each ``nonzero`` would be another).
    """
    k = chosen.shape[1]
    order = torch.argsort(chosen.flatten(), stable=True)  # (N k,) assignments grouped by expert
    counts = torch.bincount(chosen.flatten(), minlength=experts.n_experts).tolist()  # the host sync
    out = torch.zeros_like(x)
    for e, rows in enumerate(order.split(counts)):
        if len(rows) == 0:
            continue
        token, slot = rows // k, rows % k  # the tokens that chose e, and in which slot
        y = experts.expert(e, x[token]) * weights[token, slot, None].to(x.dtype)
        out = out.index_add(0, token, y)
    return out


class ExpertList(nn.ModuleList):
    """One SwiGLU ``FeedForward`` per expert: ``experts.{e}.w1/w2/w3`` (Mixtral, DeepSeek-V3)."""

    def __init__(self, c: MoeConfig) -> None:
        super().__init__(FeedForward(c.llama(c.expert_dim)) for _ in range(c.n_experts))
        self.n_experts = c.n_experts

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self[e](x)

    forward = route_tokens


class FusedExperts(nn.Module):
    """All experts in 3-D tensors with biases (GPT-OSS): ``gate_up_proj`` (E, dim, 2f) holds gate and up
    interleaved along its last dim, ``down_proj`` (E, f, dim); weights are ``[in, out]`` per expert."""

    def __init__(self, c: MoeConfig) -> None:
        super().__init__()
        e, d, f = c.n_experts, c.dim, c.expert_dim
        self.n_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, d, 2 * f))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * f))
        self.down_proj = nn.Parameter(torch.empty(e, f, d))
        self.down_proj_bias = nn.Parameter(torch.empty(e, d))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]  # (n, 2f)
        gate, up = h[..., ::2], h[..., 1::2]  # (n, f) each
        return (F.silu(gate) * up) @ self.down_proj[e] + self.down_proj_bias[e]  # (n, dim)

    forward = route_tokens


class MoE(nn.Module):
    """Router, routed experts and an optional shared expert: (B, T, dim) -> (B, T, dim) and the aux loss."""

    def __init__(self, c: MoeConfig) -> None:
        super().__init__()
        self.router = Router(c)
        self.experts = FusedExperts(c) if c.experts == "fused" else ExpertList(c)
        self.shared_expert = FeedForward(c.llama(c.shared_expert_dim)) if c.shared_expert_dim else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)  # (N, dim)
        weights, chosen, probs = self.router(tokens)
        out = self.experts(tokens, weights, chosen)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        return out.view(b, t, d), load_balancing_loss(probs, chosen)


class TransformerBlock(nn.Module):
    """The llama's pre-norm block with an MoE (or, in the first layers, a dense) feed-forward.

    Returns the block's output and its load-balancing loss (zero for a dense layer).
    """

    def __init__(self, c: MoeConfig, moe: bool) -> None:
        super().__init__()
        self.attention = Attention(c)  # MoeConfig has the llama's attention fields
        self.feed_forward = MoE(c) if moe else FeedForward(c.llama(c.dense_ffn_dim))
        self.attention_norm = RMSNorm(c.dim, c.norm_eps)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + self.attention(self.attention_norm(x))
        if isinstance(self.feed_forward, MoE):
            out, aux = self.feed_forward(self.ffn_norm(h))
        else:
            out, aux = self.feed_forward(self.ffn_norm(h)), h.new_zeros((), dtype=torch.float32)
        return h + out, aux


class MoEDecoder(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab) and the mean load-balancing loss of the MoE layers."""

    def __init__(self, c: MoeConfig = MOE_CONFIGS["mixtral-tiny"]) -> None:
        super().__init__()
        self.config = c
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList([TransformerBlock(c, c.is_moe(i)) for i in range(c.n_layers)])
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.output = nn.Linear(c.dim, c.vocab_size, bias=False)
        # Set by expert_parallel, which drops the other EP ranks' experts: each parameter's place in the
        # one-process model, so init_weights (on the meta device, unit by unit) gives it that value.
        self.one_process_places: dict[str, OneProcessPlace] | None = None

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.tok_embeddings(tokens)  # (B, T, dim)
        aux = []
        for layer in self.layers:
            h, layer_aux = layer(h)
            aux.append(layer_aux)
        n_moe = self.config.n_layers - self.config.n_dense_layers
        return self.output(self.norm(h)), torch.stack(aux).sum() / n_moe

    def init_weights(self, seed: int = 0, only: Collection[str] | None = None) -> None:
        """Give every parameter its initial value (``llama.init_parameters``: the same rule as the llama);
        under expert parallelism each kept expert gets the value it has in one process."""
        init_parameters(self, seed, only, places=self.one_process_places)


def moe_loss(output: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor, aux_loss_coef: float
             ) -> torch.Tensor:
    """Next-token cross entropy plus ``aux_loss_coef`` times the load-balancing loss (fp32)."""
    logits, aux = output
    return cross_entropy(logits, targets) + aux_loss_coef * aux
