#!/usr/bin/env bash
# Check `make install-into-env` on this machine: an environment whose torch and JAX were installed
# before, outside it, stays on them. Writes experiments/results/install_into_env.txt (minutes: torch is
# installed into the base, then pip fetches the missing pure-Python dependencies; pip's warnings about
# this machine's local index folders and root are left out).
#
#   bash experiments/check_install_into_env.sh [BASE_PYTHON]
#
# BASE_PYTHON (default: python3) gets torch and jax/jaxlib in a user site of its own (PYTHONUSERBASE in
# a temporary folder, so nothing of this machine changes); a venv made from it with
# --system-site-packages sees them, as a cluster's venv sees the CUDA torch of its module system. Then
# the target runs with the venv's python, and torch and jax must be the same versions from the same
# files after it, with ragged-fsdp importable.
set -eu -o pipefail
cd "$(dirname "$0")/.."
BASE=${1:-python3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONUSERBASE=$WORK/base
OUT=experiments/results/install_into_env.txt
where() {  # the versions and files the venv's python imports torch and jax from
    "$WORK/venv/bin/python" -c "import torch, jax; print('torch', torch.__version__, torch.__file__); print('jax', jax.__version__, jax.__file__)"
}
{
    echo "# bash experiments/check_install_into_env.sh $BASE  ($(date -u +%Y-%m-%d))"
    "$BASE" -m pip install --quiet --user --no-warn-script-location torch==2.13.0 jax==0.10.2 jaxlib==0.10.2
    "$BASE" -m venv --system-site-packages "$WORK/venv"
    echo "## before: the venv's torch and jax (from the base's user site)"
    where | tee "$WORK/before"
    echo "## make install-into-env PYTHON=venv/bin/python"
    make --no-print-directory install-into-env PYTHON="$WORK/venv/bin/python" 2>&1 | grep -v "^ *$" | tail -n 5
    echo "## after"
    where | tee "$WORK/after"
    "$WORK/venv/bin/python" -c "import ragged, torch_backend, jax_backend; print('imports ragged, torch_backend, jax_backend from', ragged.__file__)"
    "$WORK/venv/bin/python" -m pip list 2>/dev/null | grep -iE "^(torch|jax|jaxlib|flax|optax|ragged-fsdp) "
    if cmp -s "$WORK/before" "$WORK/after"; then echo "torch and jax unchanged: ok"; else echo "torch or jax CHANGED"; exit 1; fi
} 2>&1 | grep -v -e "^WARNING: Location '" -e "^WARNING: Running pip as the 'root' user" | tee "$OUT"
