#!/usr/bin/env bash
# Make (or update) the project's virtual environment .venv with Python 3.12 and install jaxserve into it.
#
#   scripts/setup_venv.sh          # jaxserve and what serving needs
#   scripts/setup_venv.sh test     # ... and the test extra (the correctness oracle, libtpu, jax's CUDA plugin)
#
# jaxserve needs Python >= 3.12 (jax 0.11 does). The interpreter is $PYTHON if set, else the first of python3.12,
# pyenv's 3.12, python3 (if it is 3.12 or newer).
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"

usable() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }

python="${PYTHON:-}"
if [ -z "$python" ]; then
    for candidate in python3.12 \
                     "$(command -v pyenv >/dev/null && ls -d "$(pyenv root)"/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)" \
                     python3; do
        if [ -n "$candidate" ] && usable "$candidate"; then python="$candidate"; break; fi
    done
fi
if [ -z "$python" ] || ! usable "$python"; then
    echo "error: jaxserve needs Python 3.12 or newer; none found (set PYTHON=/path/to/python3.12)" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ] || ! usable .venv/bin/python; then
    rm -rf .venv
    "$python" -m venv .venv
fi
.venv/bin/python -m pip install -q -e ".${extra:+[$extra]}"
echo "ready: .venv ($(.venv/bin/python -V)); activate with: source .venv/bin/activate" >&2
