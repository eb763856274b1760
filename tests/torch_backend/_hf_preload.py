"""What the gloo workers' forkserver imports for the HuggingFace cases (tests/torch_backend/_dist.py).

``transformers`` and its modeling code take about 5 s to import on a loaded 2-core machine; imported once in
the forkserver, every worker forked from it has them (a 4-rank launch of HF cases saved 4 imports, an
8-rank one 8), where each worker imported them itself before. Offline, as the HF workers set it, and
nothing at all where transformers is not installed.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
try:
    import transformers.modeling_utils  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
except Exception:  # noqa: BLE001 (not installed, or broken: the HF tests skip or fail on their own)
    pass
