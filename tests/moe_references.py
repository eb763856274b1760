"""Framework-free references for the MoE models (numpy, float64): routing, the load-balancing loss and one
MoE feed-forward, written token by token from the definitions in ``ragged.models._moe``."""

from __future__ import annotations

import numpy as np

from ragged.models import MoeConfig


def route(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, c: MoeConfig
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (N, dim) -> the top-k weights (N, k), the experts (N, k) largest score first, probs (N, E)."""
    logits = x @ weight.T + (0.0 if bias is None else bias)
    if c.scoring == "softmax":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        scores = e / e.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    experts = np.argsort(-scores, axis=-1, kind="stable")[:, :c.top_k]
    top = np.take_along_axis(scores, experts, -1)
    return top / top.sum(-1, keepdims=True) * c.routed_scale, experts, scores / scores.sum(-1, keepdims=True)


def load_balancing_loss(probs: np.ndarray, experts: np.ndarray) -> float:
    """``E * sum_e f_e P_e`` (Switch Transformer, eq. 4, with top-k assignments counted in ``f``)."""
    n_experts = probs.shape[1]
    share = np.bincount(experts.ravel(), minlength=n_experts) / experts.size
    return float(n_experts * np.sum(share * probs.mean(0)))


def _silu(z: np.ndarray) -> np.ndarray:
    return z / (1 + np.exp(-z))


def _swiglu(x: np.ndarray, params: dict, p: str) -> np.ndarray:
    return params[f"{p}.w2.weight"] @ (_silu(params[f"{p}.w1.weight"] @ x) * (params[f"{p}.w3.weight"] @ x))


def moe_ffn(x: np.ndarray, params: dict[str, np.ndarray], c: MoeConfig, p: str = "feed_forward"
            ) -> tuple[np.ndarray, float]:
    """One MoE feed-forward on tokens x (N, dim), parameters by FQN under prefix ``p``: (out, aux loss)."""
    weights, experts, probs = route(x, params[f"{p}.router.weight"], params.get(f"{p}.router.bias"), c)
    out = np.zeros_like(x)
    for n in range(len(x)):
        for slot, e in enumerate(experts[n]):
            if c.experts == "fused":
                q = f"{p}.experts"
                h = x[n] @ params[f"{q}.gate_up_proj"][e] + params[f"{q}.gate_up_proj_bias"][e]
                glu = _silu(h[0::2]) * h[1::2]  # gate and up are interleaved
                y = glu @ params[f"{q}.down_proj"][e] + params[f"{q}.down_proj_bias"][e]
            else:
                y = _swiglu(x[n], params, f"{p}.experts.{e}")
            out[n] += weights[n, slot] * y
        if c.shared_expert_dim:
            out[n] += _swiglu(x[n], params, f"{p}.shared_expert")
    return out, load_balancing_loss(probs, experts)
