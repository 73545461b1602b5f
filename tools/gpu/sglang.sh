#!/usr/bin/env bash
# SGLang adapter checks on the GPU machine. Needs SGLang 0.5.17 and its deps staged into
# $VATTN_SITE (a folder of unpacked wheels: sglang 0.5.17, sglang-kernel 0.4.5, flashinfer-python 0.6.15.post1, xgrammar 0.2.1,
# apache-tvm-ffi 0.1.11, torchvision 0.26.0 + the small pure-Python deps in
# tests/adapters/sglang/requirements-cpu.txt). Writes results under $OUT.
# The end-to-end stock-fa3 vs vattn comparison is NOT implemented yet: the vattn pool/allocator
# are not installed into SGLang's ModelRunner (out-of-tree platform hooks get_mha_kv_pool_cls /
# get_paged_allocator_cls, to be written); this script runs the module-level checks only (the
# same tests as CI: SGLang's own pools, allocation functions, ChunkCache and ForwardBatch,
# vattn vs torch_native, bit-identical) against the staged SGLang and the GPU's torch.
set -euo pipefail
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONPATH=${VATTN_SITE:?set VATTN_SITE to the folder holding sglang and its deps}:${PYTHONPATH:-}
python -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)" \
  | tee "$OUT/sglang_versions.txt"
python -m pytest -q tests/adapters/sglang -p no:cacheprovider 2>&1 | tee "$OUT/sglang_tests.txt"
