"""Ways into the trainers people already use (HF accelerate and ``transformers.Trainer``).

Lightning needs nothing here: its ``ModelParallelStrategy`` calls the user's parallelize function, which
calls ``torch_backend.fully_shard`` directly (docs/lightning.md).
"""

from torch_backend.integrations._accelerate import use_in_accelerate

__all__ = ["use_in_accelerate"]
