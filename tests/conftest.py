"""Test-wide setup that must happen before torch or jax is imported anywhere in the run.

JAX reads XLA_FLAGS once, at import: 8 host CPU devices let the JAX tests build meshes of 1, 2, 3, 4
and 8 devices in this one process. Torch multi-process tests must not fork after JAX is imported,
so they start workers with ``spawn``/``forkserver`` or use the threaded process group.
"""

import atexit
import importlib.metadata
import os
import shutil
import tempfile

from experiments._distributed import WORKER_PRELOAD_ENV

_HF_PRELOAD = "tests.torch_backend._hf_preload"

# LLVM optimization level 0: XLA:CPU compiles a quarter faster, and compiling is most of a JAX test's time
# on these small models. XLA:CPU's legacy (loop) emitters instead of its fusion emitters: a llama-tiny
# training step compiles in 1.0 s instead of 1.6 s (jaxlib 0.10; a flag XLA may retire, and an unknown
# flag aborts XLA, so it is passed to the jaxlib it was measured on only). The suite passes with and
# without each (bit-exactness checks included; the one that compares two programs bit for bit runs under
# the default emitters: jax_reference.passed_with_fusion_emitters); the benchmarks in experiments/ run at
# XLA's defaults.
_FLAGS = ["--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"]
if importlib.metadata.version("jaxlib").startswith("0.10."):
    _FLAGS.append("--xla_cpu_use_fusion_emitters=false")
for _flag in _FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The torch workers' forkserver (experiments._distributed.worker_context) also imports transformers' modeling
# code, once: about 5 s per worker otherwise, which test_fsdp_tp's 14 workers paid (153 s -> 115 s).
if _HF_PRELOAD not in os.environ.get(WORKER_PRELOAD_ENV, "").split():
    os.environ[WORKER_PRELOAD_ENV] = f"{os.environ.get(WORKER_PRELOAD_ENV, '')} {_HF_PRELOAD}".strip()

# One compilation cache per stack for the run, in a directory made for it (every run starts cold, as on a
# fresh clone) and passed on to the processes the tests start.
# JAX: a program that a test, a later test or another process already compiled (the same HLO, options and
# devices: a re-created closure, a relaunched training job) is loaded instead of compiled again. Programs
# that compile in under 0.1 s are not worth a file.
# Inductor: not its shared /tmp cache. One written natively (AVX-512 here) and read under
# ATEN_CPU_CAPABILITY=avx2 gives wrong numbers (test_fsdp_dropin's compiled float64 runs, ours and FSDP2's
# alike: 0.07 from the reference; 0 with a fresh cache; torch 2.13): a run's result would depend on the
# runs before it.
_caches = tempfile.mkdtemp(prefix="ragged-fsdp-caches-")
atexit.register(shutil.rmtree, _caches, ignore_errors=True)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_caches, "inductor"))
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ.update(JAX_COMPILATION_CACHE_DIR=os.path.join(_caches, "jax"),
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.1",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
