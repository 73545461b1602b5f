#!/usr/bin/env bash
# The engines' own servers and benchmark clients on one GPU (H200): `vattn bench serve`, stock vs
# vattn alternated (stock, vattn, stock, vattn, ...), a fresh server per run.
#   vLLM   python -m vllm.entrypoints.openai.api_server + `vllm bench serve` (vLLM 0.26.0; the
#          same bench-serve flags as 0.32.0); vattn = VATTN_VLLM=1 --attention-backend CUSTOM
#          (prefix caching on in both: the engine default)
#   SGLang python -m sglang.launch_server + sglang.bench_serving (0.5.17); vattn = VATTN_SGLANG=1
#          --attention-backend vattn --disable-prefill-cuda-graph (radix cache on in both; page size
#          set by the vattn platform)
# Stock runs with the engine's defaults (prefix caching at its default) unless VATTN_LIKE_FOR_LIKE=1
# (stock gets vattn's forced settings too). Knobs:
#   VATTN_ENGINE      vllm (default) | sglang
#   VATTN_SHAPES      model presets, in order (default "llama-1b-shape llama3-8b-shape"; config-only,
#                     dummy weights, a word-level tokenizer written next to the config)
#   VATTN_DATASET     random (default) | shared-prefix (VATTN_PREFIX_LEN, default 512, x
#                     VATTN_NUM_PREFIXES, default 8)
#   VATTN_INPUT_LEN / VATTN_OUTPUT_LEN   1024 / 256
#   VATTN_RATE_1B / VATTN_RATE_8B        requests/s (default 40 / 16: estimates near saturation,
#                     not yet measured); VATTN_PROMPTS_1B / VATTN_PROMPTS_8B (default 800 / 320:
#                     about 20 s of arrivals each)
#   VATTN_ROUNDS      rounds per shape (default 2); VATTN_SERVE_MODES the modes of a round
#                     (default "stock vattn"; one alone re-runs that side, no ratio; vLLM also
#                     takes the runner's vattn variants, e.g. "stock vattn vattn:h1:b0", each
#                     with its own column and ratio to stock)
#   VATTN_TRACE_STEPS=1  every vattn server writes its step trace (core/step_trace.py) to
#                     steps/<pid>.json in the results (`vattn bench steps --results DIR`)
#   VATTN_SERVE_ARGS  extra server arguments for both modes (e.g. "--max-num-seqs 256")
#   VATTN_PROFILE_STEPS  vLLM: profile that many engine steps of every run (`--profile-steps`;
#                     default 0 = off), VATTN_PROFILE_DELAY steps after the client starts
#                     (default 2000 at the 1B shape, 600 at 8B: inside the steady state — a window
#                     at step 300 caught the first arrivals, and the profiler's start stalled the
#                     servers for up to 2 s, 2026-12-07); the report's profile table: GPU busy /
#                     idle, kernel families, host syncs (the raw traces stay on the machine: only
#                     their numbers come back)
#   VATTN_LOOP_PROFILE=1  vLLM: every server (stock too) profiles a window of its engine-core loop
#                     (cProfile; VATTN_ENGINE_PROFILE_STEPS=SKIP:STEPS, default 2000:500 at the 1B
#                     shape, 600:200 at 8B) into loop/<shape>/<pid>.prof, .json, .txt in the
#                     results; `vattn bench loop` on each shape's folder goes into the summary
#   VATTN_BUDGET_S    wall budget of the script (default 530 s, < 9 min): a shape is skipped when
#                     less than 150 s are left, and `vattn bench serve --budget-s` skips the rounds
#                     that would not fit (estimated from the slowest run so far); both say so.
# Expected times (not yet measured; vLLM on the H200 2026-12-04: an 8B engine starts in 45-55 s, the
# first of a machine ~105 s): a run = start + ~25 s of requests + ~15 s client start, so a round of
# the 1B shape ~2 min, of the 8B ~2.5 min; both shapes x 2 rounds do not fit one call: run
#   VATTN_SHAPES=llama-1b-shape   then   VATTN_SHAPES=llama3-8b-shape   (one call each).
# Needs the engine importable: vLLM from VATTN_VLLM_SITE, SGLang from VATTN_SITE (staged folders, as
# tools/gpu/vllm.sh / sglang.sh read them). Results: $OUT/serve_results.tgz (rows.json, report.md,
# serve_plot.png and every server / client log per shape) and $OUT/serve_summary.txt.
set -u
. "$(dirname "$0")/engine_lib.sh"
begin_run serve 530
ENGINE=${VATTN_ENGINE:-vllm}
use_engine "$ENGINE" || exit 2
export VATTN_MODELS=${VATTN_MODELS:-$W/models}   # config-only models (a few kB each)
[ "${VATTN_TRACE_STEPS:-0}" = 1 ] && export VATTN_STEP_TRACE="$R/steps/{pid}.json"
LOOP_STEPS=${VATTN_ENGINE_PROFILE_STEPS:-}

pack() {
  local tmp=$W/pack.$BASHPID.tgz
  tar -czf "$tmp" --exclude='serve/*/models' --exclude='serve/*/client_home' \
    --exclude='*.pt.trace.json*' -C "$W" serve 2>/dev/null
  mv -f "$tmp" "$OUT/serve_results.tgz"
  cp "$SUM" "$OUT/serve_summary.txt.$BASHPID" && mv -f "$OUT/serve_summary.txt.$BASHPID" "$OUT/serve_summary.txt"
}
# refreshed every 30 s, so a run killed from outside still returns the logs of the run it was in
( n=0; while [ ! -e "$W/stop" ]; do sleep 1; n=$((n + 1)); [ $((n % 30)) -ne 0 ] || pack; done
) > /dev/null 2>&1 & PACKER=$!
trap 'touch "$W/stop"; wait $PACKER 2>/dev/null' EXIT

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -W ignore -c "import torch, $ENGINE; print('torch', torch.__version__, '$ENGINE', $ENGINE.__version__)"
} > "$R/env.txt" 2>&1
cat "$R/env.txt" >> "$SUM"

DATASET=${VATTN_DATASET:-random}
PREFIX=()
[ "$DATASET" = shared-prefix ] && PREFIX=(--prefix-len "${VATTN_PREFIX_LEN:-512}" --num-prefixes "${VATTN_NUM_PREFIXES:-8}")
for shape in ${VATTN_SHAPES:-llama-1b-shape llama3-8b-shape}; do
  case "$shape" in
    llama3-8b-shape) rate=${VATTN_RATE_8B:-16}; prompts=${VATTN_PROMPTS_8B:-320}; delay=600; loop=600:200 ;;
    *)               rate=${VATTN_RATE_1B:-40}; prompts=${VATTN_PROMPTS_1B:-800}; delay=2000; loop=2000:500 ;;
  esac
  if [ "${VATTN_LOOP_PROFILE:-0}" = 1 ]; then   # one folder per shape: bench loop averages a mode's windows
    export VATTN_ENGINE_PROFILE="$R/loop/$shape/{pid}" VATTN_ENGINE_PROFILE_STEPS=${LOOP_STEPS:-$loop}
  fi
  if [ "$DATASET" = shared-prefix ]; then   # a multiple of the prefixes: the same prompts per prefix
    n=${VATTN_NUM_PREFIXES:-8}; prompts=$(( (prompts + n - 1) / n * n ))
  fi
  left=$(( BUDGET - ($(date +%s) - START) - 15 ))
  # shellcheck disable=SC2086
  run_stage "serve_$shape" 150 "$left" python3 -m vattn bench serve --engine "$ENGINE" \
    --preset "$shape" --models "$VATTN_MODELS" --dataset "$DATASET" --rounds "${VATTN_ROUNDS:-2}" --modes ${VATTN_SERVE_MODES:-stock vattn} \
    --rate "$rate" --num-prompts "$prompts" --input-len "${VATTN_INPUT_LEN:-1024}" \
    --output-len "${VATTN_OUTPUT_LEN:-256}" "${PREFIX[@]}" --device cuda \
    --server-timeout 300 --client-timeout 300 --budget-s "$(( left > 30 ? left - 30 : 1 ))" \
    $([ "${VATTN_LIKE_FOR_LIKE:-0}" = 1 ] && echo --like-for-like) \
    --profile-steps "${VATTN_PROFILE_STEPS:-0}" --profile-delay "${VATTN_PROFILE_DELAY:-$delay}" \
    --out "$R/$shape" -- ${VATTN_SERVE_ARGS:-}
  if [ -d "$R/loop/$shape" ]; then   # this shape's loop windows side by side (stock is the base)
    { echo "== loop profile, $shape"
      python3 -m vattn bench loop --results "$R/loop/$shape" --top 15 2>&1 | tee "$R/loop/$shape/report.md" | head -60
    } >> "$SUM"
  fi
done
echo "== total $(( $(date +%s) - START )) s" | tee -a "$SUM"
pack
