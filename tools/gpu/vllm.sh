#!/usr/bin/env bash
# vLLM 0.26.0 on one GPU (H200): smoke -> identity -> throughput, each mode in its own engine:
#   stock       FLASH_ATTN, paged, block 16
#   ceiling     FLASH_ATTN, one max_model_len block per request (num_gpu_blocks_override = seqs + 1)
#   vattn       CUSTOM (vattn): vLLM's FA3 on virtually contiguous KV, block = one page-set
#   vattn-exact vattn with VATTN_VLLM_EXACT=1: FA3 on stock's (non-TMA) kernel path
#   vattn:pN    vattn with N MiB of packs (VATTN_PACK_MB; default 1024 with prefix caching, p0: none);
#   vattn:s1    with prefix staging on (VATTN_STAGE_PREFIXES=1; default off); vattn:gG: G layers per range
# Needs vLLM 0.26.0 importable (from PYTHONPATH, or a staged directory VATTN_VLLM_SITE). A failed
# smoke stage stops the run unless VATTN_CONTINUE=1.
#   VATTN_STAGES     stages, in order (default "smoke identity throughput"; also "profile": each
#                    mode under vLLM's torch profiler, GPU time per kernel family; "paired": two
#                    engines up at once, generations alternated, VATTN_PAIR="stock vattn",
#                    VATTN_ROUNDS=4, VATTN_PAIR_MEM=0.44; "host": `vattn bench host --device cuda`,
#                    the package linked as the other stages have it)
#   VATTN_WORKLOADS  throughput workloads (default "decode-heavy"; also "prefill-heavy long-context
#                    shared-prefix multi-turn decode-light", bench/gpu/workloads.py)
#   VATTN_BUDGET_S   wall budget of the script (default 530 s): a stage is skipped, and says so,
#                    when less than its minimum time is left; VATTN_STAGE_MAX_S caps one
#                    throughput workload (default 480 s; long-context with three modes took 338 s
#                    on a machine already up, give it up to 585 on a fresh one)
#   VATTN_MODES / VATTN_IDENTITY_MODES / VATTN_IDENTITY_EAGER / VATTN_IDENTITY_INPROC /
#   VATTN_IDENTITY_KV_BYTES (memory pressure: the same KV bytes for every mode) /
#   VATTN_IDENTITY_PREFIX (1: prompts on shared prefixes, prefix caching on; nocache: caching off) /
#   VATTN_TP (tensor_parallel_size of every mode, e.g. 2 on a two-GPU machine) /
#   VATTN_GROUP_SIZE / VATTN_REPEATS /
#   VATTN_CUDAGRAPH_MODE (e.g. PIECEWISE, all modes alike): see bench/gpu/vllm_stages.py
# Measured on the H200 (2026-12-04; engine start 45-55 s for the 8B shape with torch.compile +
# CUDA graphs, the first engine of a machine ~105 s): identity 65-105 s per mode, decode-heavy
# ~85 s per mode, prefill-heavy ~88 s, long-context ~95 s (one repeat; VATTN_REPEATS=2, the
# default, adds one generation per mode: 11 / 17 / 27 s). On one machine kept up, same day:
# profile with 4 modes 485 s, identity with 4 modes 244 s, long-context with 3 modes (one
# generation each) 338 s, decode-heavy with 3 modes x 2 generations 257 s; later that day, on a
# machine just staged: identity with 4 modes in-process 266 s, paired decode-heavy (2 engines,
# 6 rounds) 293 s. One call (< 10 min) each:
#   VATTN_STAGES=identity (4 modes) | VATTN_STAGES=throughput VATTN_WORKLOADS=decode-heavy
#   | ...=prefill-heavy | ...=long-context
# Results: $OUT/vllm_results.tgz (JSON per stage, engine logs) and $OUT/vllm_summary.txt;
# render them with `vattn bench engine --results <dir>/vllm`.
set -u
. "$(dirname "$0")/engine_lib.sh"
begin_run vllm 530   # work files stay out of $OUT: only 2 files go there
mkdir -p "$R/logs"
use_engine vllm
export VLLM_USE_V2_MODEL_RUNNER=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1
export VATTN_MODELS=${VATTN_MODELS:-/tmp/vattn-models}
# VATTN_TRACE_STEPS=1: each vattn engine writes its step trace (core/step_trace.py) to
# steps/<engine pid>.json in the results (read it with `vattn bench steps`)
[ "${VATTN_TRACE_STEPS:-0}" = 1 ] && export VATTN_STEP_TRACE="$R/steps/{pid}.json"

start_packer vllm   # pack(): engine_lib.sh


{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)'
} > "$R/env.txt" 2>&1
cat "$R/env.txt" >> "$SUM"

G="python3 -m vattn.bench.gpu.vllm_stages"
for stage in ${VATTN_STAGES:-smoke identity throughput}; do
  case "$stage" in
    smoke)
      if ! run_stage smoke 60 200 $G smoke --out "$R" && [ "${VATTN_CONTINUE:-0}" != 1 ]; then
        echo "== smoke failed: later stages skipped (VATTN_CONTINUE=1 runs them anyway)" | tee -a "$SUM"
        break
      fi ;;
    identity) run_stage identity 120 570 $G identity --out "$R" ;;
    throughput)
      for w in ${VATTN_WORKLOADS:-decode-heavy}; do
        run_stage "throughput_$w" 200 "${VATTN_STAGE_MAX_S:-480}" $G throughput --workload "$w" --out "$R"
      done ;;
    paired)    # two engines up at once, generations alternated (see vllm_stages.stage_paired)
      for w in ${VATTN_WORKLOADS:-decode-heavy}; do
        run_stage "paired_$w" 200 "${VATTN_STAGE_MAX_S:-480}" $G paired --workload "$w" --out "$R"
      done ;;
    profile)   # where the time goes, per kernel family and mode (see vllm_stages.stage_profile)
      for w in ${VATTN_WORKLOADS:-decode-heavy}; do
        run_stage "profile_$w" 200 560 $G profile --workload "$w" --out "$R"
      done ;;
    host)      # vattn's own host time per decode-heavy generation on this GPU (vattn bench host)
      run_stage host 20 120 python3 -m vattn bench host --device cuda --no-report \
        --json "$R/host_cuda.json" ;;
    *) echo "== unknown stage $stage (smoke | identity | throughput | paired | profile | host)" | tee -a "$SUM" ;;
  esac
done
echo "== total $(( $(date +%s) - START )) s" | tee -a "$SUM"
pack
