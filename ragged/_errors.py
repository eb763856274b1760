"""Errors of the core. Each message names the tensor or parameter and the rule it broke."""


class RaggedError(ValueError):
    """Base class of every error the core raises for bad input."""


class PlacementError(RaggedError):
    """A placement (``RaggedShard``) that cannot shard the given tensor."""


class GranularityError(RaggedError):
    """A granularity that is malformed or does not divide the tensor."""


class PlanningError(RaggedError):
    """A planning request that is malformed or infeasible."""
