"""The parts of ``experiments.train``: data, metrics and progress, checkpoints, one runner per stack."""
