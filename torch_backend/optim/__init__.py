"""torch_backend.optim: structure-aware optimizers on RaggedShard DTensors (and plain tensors).

``Adam8bit``: AdamW with 8-bit state quantized per 32x32 tile, each tile whole on one device.
``Muon``: distributed Muon (Newton-Schulz on a load-balanced root per matrix, or split over a group of
devices), AdamW for the rest.
"""

from torch_backend.optim._adam8bit import Adam8bit
from torch_backend.optim._muon import Muon, newton_schulz

__all__ = ["Adam8bit", "Muon", "newton_schulz"]
