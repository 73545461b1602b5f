#!/usr/bin/env bash
# The whole test suite: core, ops, conformance, bench and adapters in .venv; then each engine that
# needs its own environment (VATTN_ENGINES, default "vllm sglang"; set it empty to skip them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
.venv/bin/python -m pytest "$@"
if [[ "${VATTN_SLOW:-}" == 1 ]]; then   # on demand: the 10^6-operation state machine (minutes),
  echo "== slow tests"                  # 300-rule runs of the sharing machines
  .venv/bin/python -m pytest -q -m slow tests/core/test_state_machine.py tests/core/test_sharing_lag_machine.py
fi
echo "== Triton kernels on the CPU interpreter"
TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/core tests/adapters/vllm/test_gpu_tables.py -k interpreter
for engine in ${VATTN_ENGINES-vllm sglang}; do
  echo "== $engine tests in their own environment"
  bash "tools/engine_env.sh" "$engine"
  # the adapter's tests and the engine's conformance runner and GPU-stage tests
  ".venvs/$engine/bin/python" -m pytest -q "tests/adapters/$engine" "tests/conformance/$engine" \
    "tests/bench/$engine"
done
