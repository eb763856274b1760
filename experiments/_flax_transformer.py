"""A transformer the project did not write: flax's own layers (``nnx.Embed``, ``nnx.MultiHeadAttention``,
``nnx.Linear``, ``nnx.LayerNorm``) whose weights carry ``nnx.with_partitioning`` annotations, as flax's
sharding guide writes them: Megatron's split over a ``tensor`` mesh axis.

Used by the tensor-parallel tests and by ``experiments/jax_vs_gspmd.py --tensor``.
"""

from __future__ import annotations

import jax
from flax import nnx

LECUN, ZEROS = nnx.initializers.lecun_normal(), nnx.initializers.zeros


def annotated(spec: tuple, init=LECUN):
    """``init`` with the partitioning ``spec`` attached as the Param's metadata."""
    return nnx.with_partitioning(init, spec)


class Block(nnx.Module):
    """Pre-norm attention and MLP, Megatron's split written as flax annotations: q/k/v and the first MLP
    layer split their output heads / features, the attention output and the second MLP layer their input."""

    def __init__(self, dim: int, heads: int, hidden: int, *, rngs: nnx.Rngs):
        self.norm1, self.norm2 = nnx.LayerNorm(dim, rngs=rngs), nnx.LayerNorm(dim, rngs=rngs)
        # no biases: the key bias's gradient is zero in exact arithmetic (softmax ignores a shift shared by
        # all keys), and AdamW would turn its rounding noise into full steps in either run
        self.attn = nnx.MultiHeadAttention(
            heads, dim, kernel_init=annotated((None, "tensor", None)),
            out_kernel_init=annotated(("tensor", None, None)), use_bias=False, decode=False, keep_rngs=False,
            rngs=rngs)
        # the data axis in an annotation, as MaxText writes ("fsdp", "tensor"): the ragged buffers shard it
        self.up = nnx.Linear(dim, hidden, kernel_init=annotated(("fsdp", "tensor")),
                             bias_init=annotated(("tensor",), ZEROS), rngs=rngs)
        self.down = nnx.Linear(hidden, dim, kernel_init=annotated(("tensor", None)), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        mask = nnx.make_causal_mask(x[..., 0])
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Transformer(nnx.Module):
    """Token ids (B, T) -> logits (B, T, vocab); the embedding and the head split the vocabulary."""

    def __init__(self, vocab: int = 128, dim: int = 32, heads: int = 4, hidden: int = 96, blocks: int = 2, *,
                 rngs: nnx.Rngs):
        vocab_split = annotated(("tensor", None), nnx.initializers.normal(1.0))
        self.embed = nnx.Embed(vocab, dim, embedding_init=vocab_split, rngs=rngs)
        self.blocks = nnx.List([Block(dim, heads, hidden, rngs=rngs) for _ in range(blocks)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, kernel_init=annotated((None, "tensor")), rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def make_transformer(seed: int = 0, **sizes) -> Transformer:
    """One device's arrays (``sizes``: ``Transformer``'s); the annotations stay as metadata."""
    with nnx.use_eager_sharding(False):
        return Transformer(rngs=nnx.Rngs(seed), **sizes)
