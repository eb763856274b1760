"""experiments/env_pins.py: the pins that keep an environment's torch and JAX through ``pip install``."""

from __future__ import annotations

import importlib.metadata
from types import SimpleNamespace

import pytest

from experiments import env_pins


def _dists(**versions):
    return lambda: [SimpleNamespace(metadata={"Name": n}, version=v) for n, v in versions.items()]


def test_every_torch_and_jax_distribution_is_pinned_to_what_is_installed(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "distributions",
                        _dists(torch="2.11.0+cu130", jax="0.11.2", jaxlib="0.11.2",
                               jax_cuda13_plugin="0.11.2", flax="0.12.8", numpy="2.4.6"))
    assert env_pins.pins() == ["jax==0.11.2", "jax-cuda13-plugin==0.11.2", "jaxlib==0.11.2",
                               "torch==2.11.0+cu130"]


@pytest.mark.parametrize("versions,match", [
    ({"jax": "0.11.2"}, "torch is not installed"),
    ({"torch": "2.11.0"}, "jax is not installed"),
    ({"torch": "2.10.1+cu128", "jax": "0.11.2"}, r"torch 2\.10\.1\+cu128 is older than the 2\.11"),
])
def test_a_missing_or_old_torch_or_jax_is_refused(monkeypatch, versions, match):
    monkeypatch.setattr(importlib.metadata, "distributions", _dists(**versions))
    with pytest.raises(SystemExit, match=match):
        env_pins.pins()


def test_this_environment_pins_its_own_torch():
    assert f"torch=={importlib.metadata.version('torch')}" in env_pins.pins()
