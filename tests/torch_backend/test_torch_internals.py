"""The version gate of ``_torch_internals``: what torch versions it takes, and the internal it names."""

from __future__ import annotations

import warnings

import pytest
import torch

from torch_backend import _torch_internals


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.12.1", "2.13.0+cpu"])
def test_supported_torch_passes_quietly(monkeypatch, version):
    monkeypatch.setattr(torch, "__version__", version)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _torch_internals._check_torch()


def test_older_torch_is_refused_and_newer_warns(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.10.0+cu128")
    with pytest.raises(RuntimeError, match=r"torch >= 2\.11.*2\.10\.0"):
        _torch_internals._check_torch()
    monkeypatch.setattr(torch, "__version__", "2.14.0")
    with pytest.warns(UserWarning, match="2.11..2.13, not 2.14.0"):
        _torch_internals._check_torch()


def test_a_moved_internal_is_named(monkeypatch):
    monkeypatch.delattr(_torch_internals.ShardingPropagator, "_propagate_tensor_meta_non_cached")
    with pytest.raises(RuntimeError, match="_propagate_tensor_meta_non_cached"):
        _torch_internals._check_torch()


def test_a_rebound_function_must_stay_a_plain_function(monkeypatch):
    original = _torch_internals.dt_api.distribute_tensor
    monkeypatch.setattr(_torch_internals.dt_api, "distribute_tensor", lambda *a, **k: original(*a, **k))
    with pytest.raises(RuntimeError, match=r"distribute_tensor \(a plain function\)"):
        _torch_internals._check_torch()
