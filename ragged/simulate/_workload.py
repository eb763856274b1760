"""What one FSDP unit costs each method per step: bytes on the links, bytes through HBM, FLOPs.

Bytes come from the exact per-unit buffers: our planner's ``Layout`` and the baselines' layouts
(``ragged.bench.baseline_layouts``) of the same tensors, padding included. Every method gathers its unit's
whole buffer of ``g x S`` elements in the compute dtype and reduce-scatters the gradient in the reduce
dtype (fp32, as the memory plan keeps gradients); under HSDP the reduce-scattered shard is then
all-reduced over the replicas.

Methods differ in three ways (``METHODS``):

- the layout: ours (``plan``), FSDP2's per-parameter ``Shard(0)`` (dim 0 padded to the group size),
  Megatron-FSDP's chunk grid;
- copies: FSDP2 copies each shard into the all-gather input (copy-in) and each parameter out of the
  rank-major all-gather output (copy-out), and around the reduce-scatter copies every gradient into
  the flat reduce-scatter input with a cast to the reduce dtype (copy-in) and the reduced shard out
  into each parameter's gradient (copy-out). Ours and Megatron-FSDP gather in place (no copies);
- allocation: FSDP2's copy-out holds the flat all-gather output and the per-parameter tensors at once
  (one more unsharded unit in the compute dtype); beyond that, every baseline's allocator reserves more
  than it holds. That reserve is not derived here: it is the paper's measured figure, stated as such.

Compute per unit comes from the llama the memory plan models for the preset (``trained_llama``): a
decoder layer does ``2 x`` its matmul parameters FLOPs per token forward plus attention's
``4 n_heads head_dim seq`` (PaLM's count, as ``flops_per_token``), the output unit ``2 vocab dim``,
the embedding none. Backward is twice the forward, plus what activation checkpointing recomputes: the
whole forward (full), or under torchtitan's selective op policy every second matmul of a layer's forward
(``selective_op_gemm_flops``) and its elementwise kernels (attention's output is saved).
Elementwise kernels (norms, rotary, SiLU, residuals) move ``ELEMENTWISE_PASSES`` times the bytes the
memory plan saves per token and layer forward, twice that backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ragged._baselines import BASELINES
from ragged.bench._sweep import UnitComparison, compare_units
from ragged.models import LlamaConfig, UnitSpecs

LAYER_PREFIX = "layers."
ELEMENTWISE_PASSES = 3  # assumption: each saved activation is written once and read about twice forward


@dataclass(frozen=True)
class Method:
    """How one FSDP implementation lays out, copies and allocates (see the module docstring)."""

    name: str
    label: str
    copies: bool
    transient_units: int  # extra unsharded units in the compute dtype held at the peak
    reserve: float  # allocator reserve over what is held, a fraction (from the paper, not derived)
    reserve_source: str


METHODS = {
    "ours": Method("ours", "ours (RaggedShard + DBuffer)", False, 0, 0.0,
                   "DBuffer: batched allocation and deterministic frees, no reserve modelled"),
    "fsdp2": Method("fsdp2", "FSDP2", True, 1, 0.12,
                    "the paper: FSDP2 reserves about 12% more (per-parameter allocation)"),
    "megatron": Method("megatron", "Megatron-FSDP", False, 0, 0.24,
                       "the paper: Megatron-FSDP reserves 24-33% more; the low end taken"),
}


@dataclass(frozen=True)
class UnitCost:
    """One unit under one method for one device and one step (see the module docstring).

    Sizes are elements; ``*_bytes`` of collectives are the shard bytes per rank (what ``collective_time``
    takes); ``copy_*_bytes`` are HBM bytes read plus written by FSDP2's copies for one pass.
    """

    name: str
    group_size: int
    shard_numel: int
    used_numel: int
    ag_shard_bytes: int
    rs_shard_bytes: int
    ag_copy_in_bytes: int
    ag_copy_out_bytes: int
    rs_copy_in_bytes: int
    rs_copy_out_bytes: int
    gemm_flops: float  # forward, this device's tokens
    attention_flops: float
    elementwise_bytes: float
    selective_op_gemm_flops: float = 0.0  # the forward GEMM FLOPs torchtitan's selective op AC recomputes

    @property
    def buffer_numel(self) -> int:
        return self.group_size * self.shard_numel

    @property
    def allgather_received_bytes(self) -> int:
        """Bytes one device receives in the unit's all-gather, padding included."""
        return (self.group_size - 1) * self.ag_shard_bytes


def unit_costs(units: Sequence[UnitSpecs], method: str, group_size: int, c: LlamaConfig, *,
               tokens: int, seq_len: int, compute_bytes: int = 2, reduce_bytes: int = 4,
               compared: Sequence[UnitComparison] | None = None) -> list[UnitCost]:
    """Each unit's ``UnitCost`` under ``method`` on an FSDP group of ``group_size``.

    ``compared`` (from ``compare_units(units, group_size)``) saves planning again for each method.
    Compute goes to the units named ``layers.*`` evenly (a whole decoder layer each for a preset) and
    the output head to the last unit when it is not a layer.
    """
    compared = compared if compared is not None else compare_units(units, group_size)
    layer_units = [u for u in units if u.name.startswith(LAYER_PREFIX)]
    per_layer = layer_flops(c, seq_len)
    selective = 2.0 * sum(layer_matmuls(c)[1::2])  # per token: the 2nd, 4th, ... matmul of the forward
    share = c.n_layers / max(len(layer_units), 1)
    cb = compute_bytes
    out = []
    for i, (u, cmp) in enumerate(zip(units, compared)):
        buf = cmp.layout if method == "ours" else cmp.baselines[BASELINES.index(method)]
        s, g = buf.shard_size, group_size
        gemm = attn = elem = recomputed = 0.0
        if u.name.startswith(LAYER_PREFIX):
            gemm, attn, elem = (share * tokens * x for x in per_layer)
            recomputed = share * tokens * selective
        elif i == len(units) - 1:
            gemm = tokens * 2.0 * c.vocab_size * c.dim
        copies = METHODS[method].copies
        out.append(UnitCost(
            u.name, g, s, buf.used_numel, s * cb, s * reduce_bytes,
            ag_copy_in_bytes=2 * s * cb if copies else 0,
            ag_copy_out_bytes=2 * g * s * cb if copies else 0,
            rs_copy_in_bytes=g * s * (cb + reduce_bytes) if copies else 0,
            rs_copy_out_bytes=2 * s * reduce_bytes if copies else 0,
            gemm_flops=gemm, attention_flops=attn, elementwise_bytes=elem,
            selective_op_gemm_flops=recomputed))
    return out


def layer_matmuls(c: LlamaConfig) -> tuple[int, ...]:
    """A decoder layer's matmul weights' sizes in the order its forward calls them: wq, wk, wv, wo, then
    w1, w3, w2 (``w2(silu(w1 x) * w3 x)``, the llama's and torchtitan's order)."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    d, f = c.dim, c.ffn_dim
    return d * q, d * kv, d * kv, q * d, d * f, d * f, f * d


def layer_flops(c: LlamaConfig, seq_len: int, compute_bytes: int = 2) -> tuple[float, float, float]:
    """One decoder layer's forward per token: GEMM FLOPs, attention FLOPs, elementwise HBM bytes."""
    q = c.n_heads * c.head_dim
    matmul_params = sum(layer_matmuls(c))
    saved = compute_bytes * (2 * c.dim + 6 * q + 4 * c.ffn_dim) + 2 * 4 * c.dim  # the memory plan's
    return 2.0 * matmul_params, 4.0 * q * seq_len, ELEMENTWISE_PASSES * float(saved)
