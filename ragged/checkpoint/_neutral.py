"""The framework-neutral checkpoint: full tensors by FQN, the Layouts they were trained with, a manifest.

A checkpoint is a directory::

    manifest.json   {"format": "ragged-fsdp-checkpoint", "version": 1,
                     "tensors": {fqn: {"dtype": "bfloat16", "storage": "uint16", "shape": [...]}},
                     "meta": {...}}
    tensors.npz     one array per FQN, uncompressed, holding the exact bits
    layouts.json    [Layout.to_dict(), ...]   (informative: loading may plan another world size)

Tensors are stored whole, so any backend and any device count can load them and reshard with its own
Layouts. Dtypes numpy lacks (``bfloat16``, float8s) are stored bit-exactly as unsigned integers of the same
width, with the logical dtype name recorded; each backend turns the bits back into its own dtype.
The directory is written under a temporary name and renamed into place, so a reader never sees half a
checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ragged._errors import RaggedError
from ragged._layout import Layout

FORMAT = "ragged-fsdp-checkpoint"
VERSION = 1
_NATIVE_KINDS = "biufc"  # numpy's own bool, int, uint, float, complex dtypes are stored as they are


class CheckpointError(RaggedError):
    """A checkpoint that is malformed, inconsistent, or would overwrite another without permission."""


class StoredTensor(NamedTuple):
    """One tensor as stored: its raw ``bits`` (same shape) and its logical ``dtype`` name."""

    bits: np.ndarray
    dtype: str


class Checkpoint(NamedTuple):
    """What ``load_neutral_checkpoint`` returns."""

    tensors: dict[str, StoredTensor]
    layouts: tuple[Layout, ...]
    meta: dict[str, Any]


def encode(array: np.ndarray) -> StoredTensor:
    """A numpy array (``ml_dtypes`` ones included) as its bits and dtype name, without changing a bit."""
    array = np.asarray(array)
    if array.dtype.kind in _NATIVE_KINDS:
        return StoredTensor(array, array.dtype.name)
    # Extension dtypes (ml_dtypes' bfloat16, float8_*): reinterpret as an unsigned int of the same width.
    return StoredTensor(array.view(f"uint{8 * array.dtype.itemsize}"), array.dtype.name)


def save_neutral_checkpoint(path: str | os.PathLike, tensors: Mapping[str, np.ndarray | StoredTensor], *,
                    layouts: Sequence[Layout] = (), meta: Mapping[str, Any] | None = None,
                    overwrite: bool = False) -> Path:
    """Write a checkpoint directory atomically (temporary directory, fsync, rename).

    Args:
        path: the checkpoint directory.
        tensors: full tensors by FQN: numpy arrays, or ``StoredTensor``s for dtypes the caller holds as
            bits (a torch ``bfloat16`` tensor viewed as ``int16``/``uint16``).
        layouts: the Layouts the tensors were sharded with (recorded for readers; not needed to load).
        meta: JSON-serialisable extras (step, framework, config).
        overwrite: replace an existing checkpoint at ``path``.

    Returns:
        The checkpoint's path.

    Raises:
        CheckpointError: ``path`` exists and ``overwrite`` is False, a stored tensor's bits do not have its
            dtype's width, or a layout names a tensor that is not saved.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise CheckpointError(f"{path} exists; pass overwrite=True to replace it")
    stored = {name: t if isinstance(t, StoredTensor) else encode(t) for name, t in tensors.items()}
    entries = {}
    for name, t in stored.items():
        if t.bits.dtype.kind not in _NATIVE_KINDS:
            raise CheckpointError(f"{name}: bits of dtype {t.bits.dtype} are not a numpy integer/float dtype")
        entries[name] = {"dtype": t.dtype, "storage": t.bits.dtype.name, "shape": list(t.bits.shape)}
    for layout in layouts:
        for slot in layout.tensors:
            if slot.name not in stored:
                raise CheckpointError(f"layout {layout.name!r} names {slot.name}, which is not saved")
            if tuple(stored[slot.name].bits.shape) != slot.shape:
                raise CheckpointError(f"{slot.name}: saved shape {stored[slot.name].bits.shape} differs "
                                      f"from layout {layout.name!r}'s {slot.shape}")
    manifest = {"format": FORMAT, "version": VERSION, "tensors": entries, "meta": dict(meta or {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        with open(tmp / "tensors.npz", "wb") as f:
            np.savez(f, **{name: t.bits for name, t in stored.items()})
            _sync(f)
        _write_json(tmp / "layouts.json", [layout.to_dict() for layout in layouts])
        _write_json(tmp / "manifest.json", manifest)  # last: its presence marks a complete directory
        _replace_dir(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return path


def load_neutral_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read a checkpoint written by ``save_neutral_checkpoint`` (any backend), checked against its manifest.

    Raises:
        CheckpointError: a missing file, an unknown format or version, or tensors that differ from the
            manifest in name, shape or storage dtype.
    """
    path = Path(path)
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a checkpoint: manifest.json is missing") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        found = (manifest.get("format"), manifest.get("version"))
        raise CheckpointError(f"{path}: format and version {found}, expected {(FORMAT, VERSION)}")
    entries = manifest["tensors"]
    with np.load(path / "tensors.npz", allow_pickle=False) as npz:
        if sorted(npz.files) != sorted(entries):
            raise CheckpointError(f"{path}: tensors.npz holds {sorted(npz.files)[:5]}..., the manifest lists "
                                  f"{sorted(entries)[:5]}...")
        tensors = {}
        for name, entry in entries.items():
            bits = npz[name]
            if bits.dtype.name != entry["storage"] or list(bits.shape) != entry["shape"]:
                raise CheckpointError(f"{name}: stored {bits.dtype.name}{list(bits.shape)}, the manifest "
                                      f"says {entry['storage']}{entry['shape']}")
            tensors[name] = StoredTensor(bits, entry["dtype"])
    layouts = tuple(Layout.from_dict(d) for d in json.loads((path / "layouts.json").read_text()))
    return Checkpoint(tensors, layouts, manifest.get("meta", {}))


def _sync(f: Any) -> None:
    f.flush()
    os.fsync(f.fileno())


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        _sync(f)


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; an existing ``dst`` is moved aside first and removed after."""
    old = None
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(dst, old)
    os.rename(src, dst)
    fd = os.open(dst.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable
    finally:
        os.close(fd)
    if old is not None:
        shutil.rmtree(old)
