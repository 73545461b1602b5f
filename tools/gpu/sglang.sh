#!/usr/bin/env bash
# SGLang 0.5.17 end to end on one GPU (H200): stock `fa3` vs `--attention-backend vattn`
# (VATTN_SGLANG=1: the vattn platform makes SGLang's ModelRunner build vattn's KV pool/allocator),
# each engine in its own process (conformance/workers/sglang.py), sampling_backend="pytorch",
# SGLANG_USE_SGL_FA3_KERNEL=1, radix cache on (SGLang's default; VATTN_PREFIX_CACHING=off turns it
# off in both), page size: SGLang's for stock, one page-set for vattn. Stages (VATTN_STAGES, in order):
#   tests          the CPU suite against the staged SGLang (pool/allocator/platform/backend)
#   kernels        the GPU op tests of the sgl_fa3 kernel (decode + prefill vs the reference)
#   identity       small random Llama (4 layers, d=128, bf16 weights), 32 prompts, stock vs vattn
#   decode-heavy   Llama-3-8B shape, load_format dummy, 256 x 512 in / 512 out
#   prefill-heavy  Llama-3-8B shape, load_format dummy, 32 x 16K in / 64 out
#   long-context   8 x 64K in / 64 out;  shared-prefix  128 x (4,096 shared + 256 own) / 128
#   decode-light   64 x 1,024 in / 256 out (a server's batch at moderate load)
#   (VATTN_SHAPE=llama-1b-shape: the 1B-class shape for every throughput stage)
# Default: "identity decode-heavy prefill-heavy". Every stage runs under `timeout` and is skipped
# (and says so) when less than its minimum is left of VATTN_BUDGET_S (default 530 s, < 9 min).
# Budgets (min / max s): tests 30/90, kernels 20/120, identity 200/300, decode-heavy 150/260, prefill-heavy
# 150/260. Measured on the H200 (2026-12-04, prefill graphs still on): the first engine of a fresh
# machine starts in 104-126 s (torch.compile + graph capture), a later one in ~43 s; stock's
# decode-heavy generation took 10.9 s. Modes per throughput
# stage: VATTN_MODES (default "stock vattn", both with SGLang's decode CUDA graphs; "stock-eager" /
# "vattn-eager" without them; "vattn-nostage": vattn with prefix staging off, for an A/B; "vattn-packs": that with 1 GiB of packs of shared runs; "vattn-defer": that with deferred mapping). One engine run is capped by VATTN_RUN_TIMEOUT (200 s).
# Needs SGLang 0.5.17 and its deps importable, e.g. staged into $VATTN_SITE (a folder of unpacked
# wheels). The wheel set (CPython 3.12 x86-64 next to torch 2.11, 567 MB; ran on the H200
# 2026-12-04): sglang==0.5.17 sglang-kernel==0.4.5 flashinfer-python==0.6.15.post1 xgrammar==0.2.1
# apache-tvm-ffi==0.1.11 torchvision==0.26.0 transformers==5.12.1 tokenizers==0.22.2 and their
# dependencies, leaving out what the machine already has *except* transformers and tokenizers
# (sglang pins transformers 5.12.1: a 5.17 fails at import, "'qwen3_asr' is already used by a
# Transformers config"; 5.12.1 refuses tokenizers > 0.23.0) and, for size, tokenspeed-triton,
# nvidia-cutlass-dsl(-libs-cu12/-cu13), nvidia-nvvm, nvidia-cuda-nvcc, nvidia-cuda-nvdisasm,
# tilelang, z3-solver, nvidia-mathdx, modelscope and sgl-deep-gemm (none imported by these runs).
# Keep it apart from a vLLM site: their pins differ. Both modes run prefill eagerly
# (workers.sglang.engine_kwargs): vattn does not support SGLang's prefill CUDA graphs yet.
# Results: $OUT/sglang_results.tgz (JSON per stage, engine logs, summary), rewritten after each
# stage, and $OUT/sglang_summary.txt.
set -u
. "$(dirname "$0")/engine_lib.sh"
begin_run sglang 530
use_engine sglang    # VATTN_SGLANG is set per run, for the vattn mode only, by the runner
export SGLANG_USE_SGL_FA3_KERNEL=1
# VATTN_TRACE_STEPS=1: each vattn engine's scheduler writes its step trace (core/step_trace.py;
# one row per forward's preparation) to steps/<pid>.json in the results, whenever the engine goes
# idle (read it with `vattn bench steps --results <dir>/sglang`; VATTN_STEP_PROFILE=1 adds a profile)
[ "${VATTN_TRACE_STEPS:-0}" = 1 ] && export VATTN_STEP_TRACE="$R/steps/{pid}.json"

pack() { tar -czf "$OUT/sglang_results.tgz" --exclude=sglang/models -C "$W" sglang 2>/dev/null; cp "$SUM" "$OUT/sglang_summary.txt"; }


{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -W ignore -c 'import torch, sglang; print("torch", torch.__version__, "sglang", sglang.__version__)'
  python3 -c 'from importlib.metadata import entry_points as e; print([x.value for x in e(group="sglang.srt.platforms")])'
} > "$R/env.txt" 2>&1
cat "$R/env.txt" >> "$SUM"

G="python3 -m vattn.bench.gpu.sglang_stages"
for stage in ${VATTN_STAGES:-identity decode-heavy prefill-heavy}; do
  case "$stage" in
    tests) VATTN_CRASH_LOG=$R/tests.crash.txt run_stage tests 30 90 python3 -u -X faulthandler -m pytest -v \
             --assert=plain tests/adapters/sglang tests/conformance/sglang tests/bench/sglang -p no:cacheprovider
           if [ -s "$R/tests.crash.txt" ]; then
             { echo "-- Python frames at the crash:"; tail -c 3000 "$R/tests.crash.txt"; } >> "$SUM"; pack
           fi ;;
    kernels) run_stage kernels 20 120 python3 -m pytest -q -m gpu -k sgl_fa3 -p no:cacheprovider \
               tests/core/test_ops_decode.py tests/core/test_ops_prefill.py ;;
    identity) run_stage identity 200 300 $G identity --out "$R" ;;
    decode-heavy|prefill-heavy|long-context|shared-prefix|decode-light) run_stage "$stage" 150 "${VATTN_STAGE_MAX_S:-260}" $G "$stage" --out "$R" ;;
    *) echo "== unknown stage $stage (tests | kernels | identity | decode-heavy | prefill-heavy | long-context | shared-prefix | decode-light)" | tee -a "$SUM" ;;
  esac
done
echo "== total $(( $(date +%s) - START )) s" | tee -a "$SUM"
pack
