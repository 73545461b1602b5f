#!/usr/bin/env bash
# H200 conformance of the transformers engine, one stage per call (each well under the 10-minute
# limit of a call): stock paged|sdpa vs paged|vattn (vattn.core.ops on the CUDA VMM cache), a
# Llama-3-8B-shaped random bf16 model (hidden 4096, 32 q / 8 kv heads, d=128, vocab 128256) with
# VATTN_LAYERS layers (default 8 of 32), its weights drawn directly on the GPU (no file written).
# From the repository root:
#   OUT=/some/dir VATTN_STAGES=identity      bash tools/gpu/conformance.sh   # 32 prompts 64-1024, 64 new
#   OUT=/some/dir VATTN_STAGES=decode-heavy  bash tools/gpu/conformance.sh   # 128 prompts 256-512, 256 new
#   OUT=/some/dir VATTN_STAGES=prefill-heavy bash tools/gpu/conformance.sh   # 8 prompts 8K-32K, 8 new
# Options (env): VATTN_LAYERS=8, VATTN_NUM_REQUESTS (override the stage's prompt count),
# VATTN_MAX_BATCH_TOKENS=2048, VATTN_STAGE_TIMEOUT=420 (seconds per stage), PYTHON=python3.
# Writes $OUT/conformance/<stage>/{conformance.json,.md,*.png,log.txt}, $OUT/conformance/env.txt
# and everything tarred into $OUT/conformance_<stages>.tgz (also on failure or timeout).
# Without matplotlib there the PNGs are missing: rebuild them from the JSON on any machine with
#   python -c "import json,sys; from vattn.conformance.report import write_report as w; \
#              w(json.load(open(sys.argv[1])), sys.argv[2])" conformance.json some/dir
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
STAGES=${VATTN_STAGES:-identity decode-heavy prefill-heavy}
LAYERS=${VATTN_LAYERS:-8}
TIMEOUT=${VATTN_STAGE_TIMEOUT:-420}
PY=${PYTHON:-python3}
R="$OUT/conformance"
mkdir -p "$R"
SITE=$(mktemp -d)
ln -s "$(pwd)" "$SITE/vattn"                     # the repo root is the package vattn
export PYTHONPATH="$SITE:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  $PY -c "from vattn.core.ops import installed_backends as b, resolve_backend as r; import torch; \
print('backends', sorted(b())); d=dict(device='cuda', dtype=torch.bfloat16, head_dim=128); \
print('resolved: prefill', r('prefill', **d), 'decode', r('decode', **d))"
} > "$R/env.txt" 2>&1
cat "$R/env.txt"

status=0
for stage in $STAGES; do
  mkdir -p "$R/$stage"
  echo "== stage $stage ($LAYERS layers, timeout ${TIMEOUT}s) $(date +%T)"
  extra=()
  [ -n "${VATTN_NUM_REQUESTS:-}" ] && extra+=(--num-requests "$VATTN_NUM_REQUESTS")
  SECONDS=0
  timeout "$TIMEOUT" $PY -m vattn conformance --engine transformers --model llama3-8b-shape \
    --layers "$LAYERS" --size gpu --device cuda --dtype bfloat16 --weights instantiate \
    --workload "$stage" "${extra[@]}" \
    --engine-option max_batch_tokens="${VATTN_MAX_BATCH_TOKENS:-2048}" --engine-option block_size=256 \
    --out "$R/$stage" 2>&1 | tee "$R/$stage/log.txt"
  rc=${PIPESTATUS[0]}
  echo "== stage $stage: rc=$rc in ${SECONDS}s" | tee -a "$R/$stage/log.txt"
  [ "$rc" -ne 0 ] && status=$rc
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> "$R/$stage/log.txt" 2>&1 || true
done

name="conformance_$(echo "$STAGES" | tr ' ' '+').tgz"
tar -czf "$OUT/$name" -C "$OUT" conformance
echo "wrote $OUT/$name"
exit "$status"
