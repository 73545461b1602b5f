#!/usr/bin/env bash
# GPU checks of vattn.core.ops on one H200 (~12 minutes with every stage: split it over two calls
# with VATTN_STAGES, e.g. "tests" then "attention flex layout"). From the repository root:
#   OUT=/some/dir [VATTN_STAGES="tests attention flex layout"] [GROUP=4] bash tools/gpu/ops.sh
# ("vmm": the vattn kernels on a real VirtualKVCache beside the same data in torch memory)
# vLLM 0.26.0 staged on PYTHONPATH adds the FA3/FA2 kernels and their paged baselines. Run the tests
# alone on the GPU: beside vLLM engines (sharing the host CPUs) they ran past their limit.
# Writes $OUT/ops_results.tgz (env, test logs + junit, attention/layout json/md/png, BENCHMARKS.md).
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
R=$(mktemp -d)
STAGES=${VATTN_STAGES:-tests attention flex layout}
GROUP=${GROUP:-4}
REPO=$(pwd)
SITE=$(mktemp -d)
ln -s "$REPO" "$SITE/vattn"                      # the repo root is the package vattn
export PYTHONPATH="$SITE:${PYTHONPATH:-}"
PY=${PYTHON:-python3}
has() { case " $STAGES " in *" $1 "*) return 0;; esac; return 1; }
pack() { mkdir -p "$OUT" && cp BENCHMARKS.md "$R/" 2>/dev/null; tar -czf "$OUT/ops_results.tgz" -C "$R" .; }
# every stage packs what it has, so a call cut short still brings back the finished stages

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  $PY -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null || echo "vllm: not staged"
  $PY -c "from vattn.core.ops import installed_backends as b; print('backends', sorted(b()))"
} > "$R/env.txt" 2>&1
cat "$R/env.txt"

if has tests; then
  # one process per test file and kernel family, all at once (each is small on the GPU): a CUDA
  # error or a hang in one cannot hide the verdicts of the others; faulthandler prints where a
  # test is stuck after FAULT_S seconds
  # vLLM 0.26.0 ships its FA2 as sm80 code (cubins + PTX): on Hopper the driver JIT-compiles the
  # PTX at first use (first call 185 s in bf16, 112 s in fp16, 2026-12-04), so that family gets a longer
  # limit and a JIT cache large enough to keep what it compiled for the next process
  export CUDA_CACHE_MAXSIZE=${CUDA_CACHE_MAXSIZE:-4294967296}
  run_tests() {  # run_tests NAME FILE [-k EXPR]
    local name=$1 file=$2 limit=${TEST_LIMIT:-240}; shift 2
    case "$name" in *vllm_fa2*) limit=${FA2_LIMIT:-480};; esac
    timeout "$limit" $PY -m pytest -q -m gpu "tests/core/test_ops_$file.py" -p no:cacheprovider \
      -o faulthandler_timeout="${FAULT_S:-120}" --durations=5 --junitxml="$R/gpu_tests_$name.xml" "$@" \
      > "$R/gpu_tests_$name.txt" 2>&1
    echo "rc=$?" >> "$R/gpu_tests_$name.txt"
  }
  # TEST_FAMILIES: which kernel families to test (default all three; "others" = Triton, torch FA2,
  # SDPA); leaving vllm_fa2 out saves its minutes of JIT
  FAMILIES=" ${TEST_FAMILIES:-others vllm_fa3 vllm_fa2} "
  OTHERS="not vllm_fa3 and not vllm_fa2"
  [[ $FAMILIES == *" others "* ]] && run_tests store store &
  for f in decode prefill; do
    [[ $FAMILIES == *" others "* ]] && run_tests "$f" "$f" -k "$OTHERS" &
    [[ $FAMILIES == *" vllm_fa3 "* ]] && run_tests "${f}_vllm_fa3" "$f" -k vllm_fa3 &
    [[ $FAMILIES == *" vllm_fa2 "* ]] && run_tests "${f}_vllm_fa2" "$f" -k vllm_fa2 &
  done
  wait
  for f in "$R"/gpu_tests_*.txt; do echo "== $(basename "$f" .txt)"; grep -E "passed|failed|error|rc=|Timeout" "$f" | tail -3; done
  pack
fi

bench() {  # bench NAME ARGS... : run vattn bench NAME with a time limit, log to $R/NAME*.txt
  local name=$1 limit=$2; shift 2
  timeout "$limit" $PY -u -m vattn bench "$name" --out "$R" "$@" 2>&1
}
if has attention; then
  echo "== bench attention (G=$GROUP)"
  # --budget-s: no new shape after ATT_BUDGET s, so the report is still written inside the limit
  # ATT_MODELS / ATT_CONTEXTS / ATT_BATCHES / ATT_PREFILL narrow the grid, e.g. the head_dim-64
  # shape at a server's batch: ATT_MODELS=llama-1b ATT_CONTEXTS=1024,2048 ATT_BATCHES=16,64
  bench attention $(( ${ATT_BUDGET:-300} + 90 )) --models "${ATT_MODELS:-llama3-8b,yi-6b,yi-34b}" \
    --contexts "${ATT_CONTEXTS:-1024,8192,32768,131072}" --batches "${ATT_BATCHES:-1,16,64,256}" \
    --prefill-contexts "${ATT_PREFILL:-8192,16384,32768}" \
    --group-size "$GROUP" --budget-s "${ATT_BUDGET:-300}" > "$R/attention.txt"
  tail -60 "$R/attention.txt"; pack
fi
if has flex; then
  echo "== bench attention with FlexAttention paged (few shapes: compiles per shape)"
  mkdir -p "$R/flex"
  timeout 200 $PY -u -m vattn bench attention --out "$R/flex" --no-report --flex --models llama3-8b \
    --contexts 8192 --batches 16,64 --prefill-contexts 16384 --group-size "$GROUP" 2>&1 \
    > "$R/flex/attention.txt"
  tail -8 "$R/flex/attention.txt"; pack
fi
if has vmm; then   # the same kernels on a real VirtualKVCache (2 MiB pages mapped one by one)
  echo "== bench attention --vmm (torch memory vs VMM pages, same data, same layout)"
  mkdir -p "$R/vmm"
  timeout 300 $PY -u -m vattn bench attention --out "$R/vmm" --no-report --vmm --models llama3-8b \
    --contexts "${VMM_CONTEXTS:-1024,8192,32768}" --batches "${VMM_BATCHES:-1,64,256}" \
    --prefill-contexts "${VMM_PREFILL:-16384}" --group-size "$GROUP" \
    --budget-s "${VMM_BUDGET:-200}" > "$R/vmm/attention.txt" 2>&1
  tail -30 "$R/vmm/attention.txt"; pack
fi
if has layout; then
  echo "== bench layout"
  bench layout 200 --model-shape llama3-8b --groups "${LAYOUT_GROUPS:-split,1,2,4,8,all}" \
    --decode-cases "${LAYOUT_DECODE:-128x2048,32x8192,8x32768}" \
    --prefill-cases "${LAYOUT_PREFILL-1x16384}" > "$R/layout.txt"
  tail -14 "$R/layout.txt"; pack
fi
pack
echo "results in $OUT/ops_results.tgz"
