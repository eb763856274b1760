"""torch_backend.optim: structure-aware optimizers on RaggedShard DTensors (and plain tensors).

``Adam8bit``: AdamW with 8-bit state quantized per 32x32 tile, each tile whole on one device;
``requantize_moments`` is its store-and-load of fp32 moments, and ``to_tiles`` / ``from_tiles`` the tile
order of a local slice (for analyses of the 8-bit state, e.g. ``experiments.adam8bit_moment_error``).
``Muon``: distributed Muon (Newton-Schulz of each matrix on one load-balanced device, its NS device, or
split over a group of devices), AdamW for the rest.
"""

from torch_backend.optim._adam8bit import Adam8bit, from_tiles, requantize_moments, to_tiles
from torch_backend.optim._muon import Muon, newton_schulz

__all__ = ["Adam8bit", "Muon", "from_tiles", "newton_schulz", "requantize_moments", "to_tiles"]
