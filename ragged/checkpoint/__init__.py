"""The framework-neutral checkpoint: full tensors by FQN and the Layouts they were trained with, in a
directory both runtimes write and read (any world size can load it). ``CheckpointError`` is the one
checkpoint error of the project (the torch runtime's DCP path raises it too)."""

from ragged.checkpoint._neutral import (
    Checkpoint,
    CheckpointError,
    StoredTensor,
    load_neutral_checkpoint,
    save_neutral_checkpoint,
)

__all__ = [
    "save_neutral_checkpoint",
    "load_neutral_checkpoint",
    "Checkpoint",
    "StoredTensor",
    "CheckpointError",
]
