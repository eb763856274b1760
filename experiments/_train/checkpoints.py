"""Checkpoint directories of a run: ``<dir>/step_<N>`` (complete ones only) and the run's settings.

A step directory is written as ``step_<N>.partial`` and renamed once every rank has written its part, so
the newest ``step_<N>`` is always complete and a relaunch resumes from it. ``run.json`` holds the settings
a resume must keep (model, stack, world size, ...); a relaunch with other settings is refused.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

_STEP = re.compile(r"^step_(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    """The checkpoint taken after ``step`` steps."""
    return root / f"step_{step:08d}"


def latest(root: Path | None) -> tuple[int, Path] | None:
    """The newest complete checkpoint ``(steps done, path)``, or None."""
    if root is None or not root.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP.match(p.name))]
    return max(found) if found else None


def check_settings(root: Path, settings: dict, write: bool) -> None:
    """Refuse to resume a run under other settings; ``write`` (rank 0) records them on a first launch."""
    path = root / "run.json"
    if path.exists():
        saved = json.loads(path.read_text())
        changed = {k: (saved.get(k), v) for k, v in settings.items() if saved.get(k) != v}
        if changed:
            raise SystemExit(f"--checkpoint-dir {str(root)!r} holds a run with other settings "
                             f"(setting: (saved, now)) {changed}; use a new directory or the same settings")
    elif write:
        root.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings, indent=1))
