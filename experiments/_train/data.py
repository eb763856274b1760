"""Token batches: synthetic by default, or a memory-mapped ``.bin`` token file (nanoGPT's convention).

Both are functions of ``(seed, step, row)`` only, so a run is reproducible, every rank reads just its own
rows of the global batch, and a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


class TokenSource:
    """The global batch of a step is ``batch`` rows of ``seq_len + 1`` tokens; rows are read on demand.

    Args:
        vocab_size: tokens must be below it (a token file is checked batch by batch).
        seq_len, batch, seed: the shape of a global batch and the sampler's seed.
        path: a ``.bin`` file of token ids (``dtype`` uint16 or uint32, no header); None: synthetic rows
            that count up by a stride from a random start (learnable in context: the loss falls).
    """

    def __init__(self, vocab_size: int, seq_len: int, batch: int, seed: int = 0, path: str | None = None,
                 dtype: str = "uint16") -> None:
        self.vocab_size, self.seq_len, self.batch, self.seed = vocab_size, seq_len, batch, seed
        self.path = path
        self.tokens = None
        if path is not None:
            if dtype not in ("uint16", "uint32"):
                raise ValueError(f"--data-dtype {dtype!r}: a token file holds uint16 or uint32 ids")
            if not Path(path).is_file():
                raise FileNotFoundError(f"--data {path!r}: no such token file")
            self.tokens = np.memmap(path, dtype=dtype, mode="r")
            if len(self.tokens) < seq_len + 2:
                raise ValueError(f"--data {path!r} holds {len(self.tokens)} tokens; a row needs "
                                 f"{seq_len + 1}")

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of step ``step``'s global batch: int32 ``(stop - start, seq_len + 1)``."""
        rng = np.random.default_rng([self.seed, step])
        if self.tokens is None:
            first = rng.integers(0, self.vocab_size, self.batch)[start:stop, None]
            stride = rng.integers(1, 4, self.batch)[start:stop, None]
            return ((first + stride * np.arange(self.seq_len + 1)) % self.vocab_size).astype(np.int32)
        offsets = rng.integers(0, len(self.tokens) - self.seq_len - 1, self.batch)[start:stop]
        out = np.stack([np.asarray(self.tokens[o:o + self.seq_len + 1]) for o in offsets]).astype(np.int32)
        if out.size and out.max() >= self.vocab_size:
            raise ValueError(f"--data {self.path!r}: token id {int(out.max())} at step {step} is not below "
                             f"the model's vocabulary of {self.vocab_size}")
        return out
