#!/usr/bin/env bash
# GPU checks of vattn.core.ops on one H200, ~6 minutes. Run from the repository root:
#   OUT=/some/dir bash tools/gpu/ops.sh
# Writes under $OUT: env.txt, gpu_tests.txt (+ junit xml), triton_decode_tuning.{txt,json},
# attention.{json,md,txt} + attention_*_ratio.png, layout.{json,md,txt}, BENCHMARKS.md.
# Optional: vLLM 0.26.0 staged on PYTHONPATH adds the FA3/FA2 paged baselines.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
REPO=$(pwd)
SITE=$(mktemp -d)
ln -s "$REPO" "$SITE/vattn"                      # the repo root is the package vattn
export PYTHONPATH="$SITE:${PYTHONPATH:-}"
PY=${PYTHON:-python3}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  $PY -c "from vattn.core.ops import installed_backends as b; print('backends', sorted(b()))"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== GPU tests"
timeout 150 $PY -m pytest -q -m gpu tests/core/test_ops_store.py tests/core/test_ops_decode.py \
  tests/core/test_ops_prefill.py tests/core/test_ops_dispatch.py -p no:cacheprovider \
  --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.txt" 2>&1
tail -5 "$OUT/gpu_tests.txt"

echo "== Triton decode tuning"
timeout 120 $PY tools/gpu/tune_decode.py --out "$OUT" 2>&1 | tee "$OUT/triton_decode_tuning.txt" | grep -E "best|BEST"

echo "== bench attention"
timeout 150 $PY - "$OUT" <<'PY' 2>&1 | tee "$OUT/attention.txt" | tail -30
import argparse, sys
from vattn.bench import attention
p = argparse.ArgumentParser(); attention.add_arguments(p)
args = p.parse_args(["--models", "llama3-8b,yi-6b,yi-34b", "--contexts", "1024,8192,32768,131072",
                     "--batches", "1,16,64,256", "--prefill-contexts", "16384,32768",
                     "--max-tokens", str(2 << 20), "--out", sys.argv[1]])
raise SystemExit(attention.run(args))
PY

echo "== bench layout"
timeout 120 $PY - "$OUT" <<'PY' 2>&1 | tee "$OUT/layout.txt" | tail -15
import argparse, sys
from vattn.bench import layout
p = argparse.ArgumentParser(); layout.add_arguments(p)
args = p.parse_args(["--model-shape", "llama3-8b", "--groups", "split,1,2,4,8,all",
                     "--decode-cases", "128x2048,32x8192", "--prefill-cases", "1x16384",
                     "--out", sys.argv[1]])
raise SystemExit(layout.run(args))
PY
cp BENCHMARKS.md "$OUT/" 2>/dev/null || true
echo "results in $OUT"
