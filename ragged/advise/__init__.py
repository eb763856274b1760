"""The HSDP advisor (``ragged advise``): the FSDP group size and the merging of adjacent layers into
one unit that keep a model's padding under a target on a given number of GPUs."""

from ragged.advise._advise import Advice, HsdpOption, advise

__all__ = ["advise", "Advice", "HsdpOption"]
