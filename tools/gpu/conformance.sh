#!/usr/bin/env bash
# H200 conformance of the transformers engine: a Llama-3-8B-shaped random bf16 model (built here,
# no weights shipped), identity + decode-heavy (128 requests) + prefill-heavy (8K-32K prompts),
# stock paged|sdpa vs paged|vattn on the CUDA backend. Writes the report under $OUT/conformance.
# Usage (repository root, vattn importable): OUT=/some/dir bash tools/gpu/conformance.sh
set -euo pipefail
OUT="${OUT:-reports}"
MODELS="${VATTN_MODELS_DIR:-/tmp/vattn-models}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT/conformance"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
# identity first (exact token match required: same SDPA on both sides), then throughput
"$PY" -m vattn conformance --engine transformers --model llama3-8b-shape --size gpu \
  --device cuda --dtype bfloat16 --models-dir "$MODELS" \
  --workload identity --workload decode-heavy --workload prefill-heavy \
  --engine-option max_batch_tokens="${VATTN_MAX_BATCH_TOKENS:-2048}" \
  --engine-option block_size=256 \
  --out "$OUT/conformance" 2>&1 | grep -v "Loading weights" | tee "$OUT/conformance/log.txt"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$OUT/conformance/log.txt" || true
