"""The parts of ``experiments.train``: data, metrics and progress, checkpoint directories, one runner per stack."""
