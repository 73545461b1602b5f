#!/usr/bin/env bash
# Soak on one GPU: `vattn bench soak`, one engine server with vattn under mixed load for most of
# a device call (< 10 min), then the page audit. vLLM 0.26.0 (`vllm.entrypoints.openai.api_server`,
# VATTN_VLLM=1 --attention-backend CUSTOM, prefix caching on: vLLM's default) or SGLang 0.5.17
# (`sglang.launch_server --attention-backend vattn`, radix cache on). Knobs:
#   VATTN_ENGINE      vllm (default) | sglang
#   VATTN_SHAPE       model preset (default llama-1b-shape: the most requests per minute)
#   VATTN_MODE        vattn (default) | stock (the same load on the stock server, for its RSS/fds)
#   VATTN_REQUESTS    requests to send (default 100000; the duration usually ends the load first)
#   VATTN_RATE        arrivals per second (default 300: beyond what one GPU serves, so the client's
#                     VATTN_MAX_IN_FLIGHT (default 512) open requests keep the server saturated)
#   VATTN_DURATION    seconds of load (default: what the budget leaves after ~150 s of server start
#                     and ~40 s of drain and final check)
#   VATTN_INPUT_LEN / VATTN_OUTPUT_LEN   LOW:HIGH tokens, log-uniform (default 1:8192 / 1:1024)
#   VATTN_ABORT       share of requests the client hangs up on mid-stream (default 0.05)
#   VATTN_SERVE_ARGS  extra server arguments (e.g. "--max-model-len 16384")
#   VATTN_BUDGET_S    wall budget of the script (default 540 s)
# Needs the engine importable: vLLM from VATTN_VLLM_SITE, SGLang from VATTN_SITE (staged folders, as
# tools/gpu/vllm.sh / sglang.sh read them). Results: $OUT/soak_results.tgz (soak.md, soak.png,
# result.json, samples.jsonl, requests.jsonl, server.log) and $OUT/soak_summary.txt.
set -u
. "$(dirname "$0")/engine_lib.sh"
begin_run soak 540
ENGINE=${VATTN_ENGINE:-vllm}
use_engine "$ENGINE" || exit 2
start_packer soak
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -W ignore -c "import torch, $ENGINE; print('torch', torch.__version__, '$ENGINE', $ENGINE.__version__)"
} > "$R/env.txt" 2>&1
cat "$R/env.txt" >> "$SUM"
DURATION=${VATTN_DURATION:-$(( BUDGET - ($(date +%s) - START) - 190 ))}
left=$(( BUDGET - ($(date +%s) - START) - 5 ))
# shellcheck disable=SC2086
run_stage "soak_${VATTN_SHAPE:-llama-1b-shape}" 240 "$left" python3 -m vattn bench soak \
  --engine "$ENGINE" --preset "${VATTN_SHAPE:-llama-1b-shape}" --models "$W/models" \
  --mode "${VATTN_MODE:-vattn}" --requests "${VATTN_REQUESTS:-100000}" --rate "${VATTN_RATE:-300}" \
  --duration "$DURATION" --input-len "${VATTN_INPUT_LEN:-1:8192}" --output-len "${VATTN_OUTPUT_LEN:-1:1024}" \
  --abort "${VATTN_ABORT:-0.05}" --max-in-flight "${VATTN_MAX_IN_FLIGHT:-512}" --device cuda \
  --sample-s 2 --progress-s 30 --server-timeout 240 --out "$R/run" -- ${VATTN_SERVE_ARGS:-}
echo "== total $(( $(date +%s) - START )) s" | tee -a "$SUM"
pack
