#!/usr/bin/env bash
# Download, on a machine that reaches PyPI, the wheels the GPU check (tools/gpu_check.py) needs on
# a GPU machine whose image lacks them, and print their sizes and total (it must stay under the
# 64 MiB a device call may carry). The image (docs/gpu.md): Python 3.12, torch 2.11 + CUDA 13,
# transformers, tokenizers, safetensors, huggingface-hub, numpy, pyyaml, psutil, tqdm, aiohttp,
# tensorboard, matplotlib, nvidia-ml-py, pyarrow, pandas, requests, xxhash, sympy, pytest; no
# megatron-core, Transformer Engine, SGLang or flash-attn, and no network.
#
#   tools/gpu_wheels.sh [DEST]                    # default DEST: .whl (git-ignored)
#   tools/gpu_wheels.sh --verify PYTHON [DEST]    # then rehearse the GPU machine on this one
#
# What is missing there: megatron-core 0.19.2 (its own requirements, torch, numpy and packaging,
# are in the image); transformers 5.24.0, because the image's 5.17 is older than the hf engine
# needs (rollout/local/hf_model.py: MIN_TRANSFORMERS; its requirements, huggingface-hub >= 1.31,
# tokenizers 0.23, safetensors 0.8, regex, typer, are the image's); and of our install_requires
# pybase64 (weight-sync payloads), datasets with dill and multiprocess (prompt files), math-verify
# with latex2sympy2_extended and the ANTLR runtime (the math reward). Versions are the ones the
# CPU suite runs. They go first on PYTHONPATH, so transformers 5.24 shadows the image's. On the
# GPU machine:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site python3 tools/gpu_check.py --out "$OUT"
# (docs/gpu.md has the whole device command). --verify PYTHON installs them the same way for
# PYTHON, a Python 3.12 that holds only the image's packages (a CPU machine: torch runs on its
# CPU), and runs `tools/gpu_check.py --dry-run` with it: every module the check imports, every
# step built and run at a tiny size, with nothing but the image's packages and these wheels.
set -euo pipefail
cd "$(dirname "$0")/.."

VERIFY_PYTHON=""
if [[ "${1:-}" == "--verify" ]]; then
    VERIFY_PYTHON="${2:?--verify needs a Python 3.12 interpreter}"
    shift 2
fi
DEST="${1:-.whl}"
LIMIT=$((64 << 20))
WHEELS=(
    megatron-core==0.19.2
    transformers==5.24.0
    pybase64==1.5.1
    datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
    math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
)
PLATFORMS=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$tag")
done

# A fresh folder each time: two versions of one package stop the whole install there.
staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$staging" "${WHEELS[@]}"
rm -rf "$DEST"
mkdir -p "$DEST"
mv "$staging"/*.whl "$DEST"/

total=0
for wheel in "$DEST"/*.whl; do
    size=$(stat -c %s "$wheel")
    total=$((total + size))
    printf '%10d  %s\n' "$size" "$(basename "$wheel")"
done
printf 'gpu_wheels: %d wheels, %d bytes (%.2f MiB) in %s; the limit is 64 MiB with the working tree\n' \
    "$(ls "$DEST"/*.whl | wc -l)" "$total" "$(echo "$total / 1048576" | bc -l)" "$DEST"
if (( total > LIMIT )); then
    echo "gpu_wheels: error: the wheels exceed 64 MiB" >&2
    exit 1
fi

if [[ -n "$VERIFY_PYTHON" ]]; then
    "$VERIFY_PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' \
        || { echo "gpu_wheels: error: --verify needs Python 3.12 (the image's)" >&2; exit 2; }
    site=$(mktemp -d)
    out=$(mktemp -d)
    trap 'rm -rf "$staging" "$site" "$out"' EXIT
    "$VERIFY_PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$DEST"/*.whl
    PYTHONPATH="$site" "$VERIFY_PYTHON" tools/gpu_check.py --dry-run --out "$out" \
        || { cat "$out/gpu_check.log" >&2; exit 1; }
    echo "gpu_wheels: the dry run passed with $VERIFY_PYTHON and these wheels alone"
fi
