"""The neutral checkpoint format: exact bits, layouts, manifest checks and atomic replacement."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

import ragged
from ragged.checkpoint import CheckpointError, StoredTensor, load_neutral_checkpoint, save_neutral_checkpoint
from ragged.checkpoint._neutral import encode


def tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "tok_embeddings.weight": rng.standard_normal((8, 4)).astype(np.float32),
        "norm.weight": rng.standard_normal(4).astype(ml_dtypes.bfloat16),
        "steps": np.arange(3, dtype=np.int64),
        "mask": np.array([True, False]),
        "scalar": np.float64(np.pi) * np.ones(()),
    }


def test_round_trip_is_bit_exact_with_layouts_and_meta(tmp_path):
    src = tensors()
    layout = ragged.plan([("tok_embeddings.weight", (8, 4), "rows:1")], 3, name="tok_embeddings")
    save_neutral_checkpoint(tmp_path / "ck", src, layouts=[layout], meta={"step": 7})
    ck = load_neutral_checkpoint(tmp_path / "ck")
    assert ck.meta == {"step": 7}
    assert ck.layouts == (layout,)
    assert list(ck.tensors) == list(src)
    for name, value in src.items():
        stored = ck.tensors[name]
        assert stored.dtype == value.dtype.name and stored.bits.shape == value.shape
        assert stored.bits.tobytes() == value.tobytes(), name
    bf16 = ck.tensors["norm.weight"]
    assert bf16.bits.dtype == np.uint16
    assert np.array_equal(bf16.bits.view(ml_dtypes.bfloat16), src["norm.weight"])


def test_bits_given_by_a_backend_are_stored_as_given(tmp_path):
    bits = np.array([0x3F80, 0x7FC0, 0xFF80], dtype=np.uint16)  # bf16 1.0, NaN, -inf as raw bits
    save_neutral_checkpoint(tmp_path / "ck", {"w": StoredTensor(bits, "bfloat16")})
    got = load_neutral_checkpoint(tmp_path / "ck").tensors["w"]
    assert got.dtype == "bfloat16" and got.bits.tobytes() == bits.tobytes()
    assert encode(bits.view(ml_dtypes.bfloat16)).bits.tobytes() == bits.tobytes()


def test_existing_checkpoint_is_kept_unless_overwrite(tmp_path, monkeypatch):
    save_neutral_checkpoint(tmp_path / "ck", {"a": np.zeros(2)})
    with pytest.raises(CheckpointError, match="exists; pass overwrite=True"):
        save_neutral_checkpoint(tmp_path / "ck", {"a": np.ones(2)})

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", crash)
    with pytest.raises(OSError, match="disk full"):
        save_neutral_checkpoint(tmp_path / "ck", {"a": np.ones(2)}, overwrite=True)
    monkeypatch.undo()
    assert np.array_equal(load_neutral_checkpoint(tmp_path / "ck").tensors["a"].bits, np.zeros(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temporary directory left behind
    save_neutral_checkpoint(tmp_path / "ck", {"a": np.ones(2)}, overwrite=True)
    assert np.array_equal(load_neutral_checkpoint(tmp_path / "ck").tensors["a"].bits, np.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_bad_checkpoints_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        load_neutral_checkpoint(tmp_path)
    layout = ragged.plan([("w", (4, 2))], 2, name="u")
    with pytest.raises(CheckpointError, match="layout 'u' names w, which is not saved"):
        save_neutral_checkpoint(tmp_path / "x", {"v": np.zeros(2)}, layouts=[layout])
    with pytest.raises(CheckpointError, match=r"w: saved shape \(8,\) differs from layout 'u'"):
        save_neutral_checkpoint(tmp_path / "x", {"w": np.zeros(8)}, layouts=[layout])
    save_neutral_checkpoint(tmp_path / "ck", {"w": np.zeros((4, 2), np.float32)})
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    manifest["tensors"]["w"]["shape"] = [8]
    (tmp_path / "ck" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"w: stored float32\[4, 2\], the manifest says float32\[8\]"):
        load_neutral_checkpoint(tmp_path / "ck")
    manifest["version"] = 99
    (tmp_path / "ck" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="version"):
        load_neutral_checkpoint(tmp_path / "ck")
