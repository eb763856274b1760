"""The tour notebook runs top to bottom in a fresh kernel, and its training cells' losses agree.

The notebook asserts the agreement itself (torch fully_shard and JAX against the 1-process reference,
within ``experiments.demo.LOSS_RTOL``, the worst-case rounding of the batch mean summed in another order,
as the demo's test), for llama-tiny and for a model written in the notebook; here any cell error
fails the test, and the loss gaps the notebook prints are re-read and bounded again, so a notebook whose
assertions were edited away still fails on a disagreement.
"""

import re
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from experiments._distributed import WORKER_PRELOAD_ENV
from experiments._xla import flags_but_device_count
from experiments.demo import LOSS_RTOL

NOTEBOOK = Path(__file__).resolve().parents[2] / "experiments" / "notebooks" / "tour.ipynb"
LOSS_GAP = re.compile(r"(\S+) loss gap vs reference: torch (\S+), JAX (\S+)")


def test_tour_notebook_runs_and_its_losses_agree(monkeypatch):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    # The notebook adds its own device count, as in a user kernel; the run's other flags stay (its
    # optimization level, an ISA limit)
    monkeypatch.setenv("XLA_FLAGS", flags_but_device_count())
    # Nor the suite's forkserver preload (tests/conftest.py): the kernel's torch workers train no
    # HuggingFace model, and importing transformers' modeling code there costs about 5 s on 2 cores
    monkeypatch.delenv(WORKER_PRELOAD_ENV, raising=False)
    client = NotebookClient(nb, timeout=240, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    gaps = {model: (float(t), float(j)) for model, t, j in LOSS_GAP.findall(text)}
    assert set(gaps) == {"llama-tiny", "TinyMixer"}, text
    assert all(gap <= LOSS_RTOL for pair in gaps.values() for gap in pair), gaps
    assert "bit for bit" in text  # torch -> neutral checkpoint -> JAX buffers
    assert "'ragged': 0" in text  # 8-bit Adam's tile bands: none cut by the planner
