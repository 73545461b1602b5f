#!/usr/bin/env bash
# `vattn compare --shape` on one GPU (H200): one model shape and one workload set through every
# engine, stock vs vattn in alternated rounds (stock, vattn, stock, vattn, ...; a fresh engine per
# run, its start not timed), one table + plot (conformance/compare*.py). Columns per engine: stock
# and vattn seconds, vattn's speed over stock with the spread of the per-round ratios, the identity
# verdict, worst waste per request, VMM critical-path share, HBM share (decode-heavy: the decode
# traffic's lower bound over the copy bandwidth, measured once at the start), and a row for every
# engine that is not installed.
# Each engine runs in an interpreter of its own: python3 with the repository linked as `vattn`
# (engine_lib.sh's shim, every engine's entry points) and, first on its PYTHONPATH, the engine's
# staged folder: vLLM 0.26.0 from VATTN_VLLM_SITE, SGLang 0.5.17 from VATTN_SITE (folders of
# unpacked wheels, as tools/gpu/vllm.sh and sglang.sh read them; the two pin different packages,
# so each stays on its own engine's path). transformers (5.17) and TGI run under the machine's
# python3 as it is.
# Every engine starts with its own defaults plus vattn's activation only; to see exactly what, run
#   python3 -m vattn compare --shape llama3-8b-shape --dry-run
#   vLLM    LLM(model, load_format="dummy", dtype=bfloat16, seed=0, skip_tokenizer_init) with vLLM's
#           own sizing (max_model_len = the model's 131,072 positions, max_num_seqs, memory), prefix
#           caching as it defaults (on), CUDA graphs, V2 model runner; stock attention_backend
#           FLASH_ATTN (block 16), vattn CUSTOM with VATTN_VLLM=1
#   SGLang  sglang.Engine(model_path, load_format="dummy", dtype=bfloat16, random_seed=0,
#           sampling_backend="pytorch", skip_tokenizer_init, disable_prefill_cuda_graph) with SGLang's
#           own sizing and radix cache, decode CUDA graphs, SGLANG_USE_SGL_FA3_KERNEL=1; stock
#           attention_backend fa3, vattn attention_backend vattn with VATTN_SGLANG=1
#   transformers  the seeded weights (std 0.02) drawn on the GPU, continuous batching with
#           256-token blocks and 2,048 batch tokens, paged|sdpa vs paged|vattn
#   TGI     its runner runs on the CPU only: a row says so (or "not installed")
# Knobs:
#   VATTN_ENGINES    engines, in order, one `vattn compare` each under `timeout` (default
#                    "vllm sglang transformers tgi")
#   VATTN_SHAPE      llama3-8b-shape (default; 131,072 positions) | llama-1b-shape
#   VATTN_WORKLOADS  comma-separated: decode-heavy (default; 256 x 512 in / 512 out), prefill-heavy
#                    (32 x 16K / 64), long-context (8 x 64K / 64), shared-prefix (128 x (4,096
#                    shared + 256) / 128): bench/gpu/workloads.py, the same prompts for every engine
#   VATTN_ROUNDS     alternated rounds per engine and workload (default 3, at least 3)
#   VATTN_LAYERS     override the shape's layer count; VATTN_NUM_REQUESTS: the first N prompts only
#   VATTN_ENGINE_OPTIONS  space-separated ENGINE:KEY=VALUE engine arguments added to both modes,
#                    e.g. "vllm:max_model_len=32768 sglang:mem_fraction_static=0.8"
#   VATTN_LOGPROBS   top-k log-probs of every run (default 5, for the near-tie verdict; 0 times the
#                    runs without them, and a divergence cannot be judged then)
#   VATTN_HBM_TBPS   copy bandwidth in TB/s (default: measured once here, a 4 GiB device copy)
#   VATTN_BUDGET_S   wall budget of the script (default 530 s). Each engine gets what is left minus
#                    the minimums of the engines after it (vllm 200, sglang 200, transformers 150,
#                    tgi 20 s; an engine is skipped, and says so, below its minimum). Inside an
#                    engine no round starts that would not end in time (judged by its slowest
#                    round): its row then says "stopped after N of 3 rounds"; a stopped run keeps
#                    the rounds that finished.
# Time (estimated from the stage scripts' H200 runs, not yet measured with compare): an 8B-shaped
# engine starts in 45-55 s (the first of a fresh machine ~105 s for vLLM, ~125 s for SGLang) and a
# decode-heavy generation takes ~10 s, so 3 rounds (6 engines) of one engine take ~6.5-7.5 min:
# one engine per call. The 1B shape starts faster but not by much (torch.compile and graph capture
# dominate). transformers' stock path is slow (its 8-layer decode-heavy took 23.6 s at a quarter of
# this workload): on the 8B shape expect its rounds cut by the budget. So, one call each:
#   OUT=... VATTN_VLLM_SITE=<vLLM folder> VATTN_ENGINES=vllm  bash tools/gpu/compare.sh
#   OUT=... VATTN_SITE=<SGLang folder>    VATTN_ENGINES=sglang bash tools/gpu/compare.sh
#   OUT=... VATTN_ENGINES="transformers tgi"                   bash tools/gpu/compare.sh
# then one table of all three: vattn compare --results <dir1> <dir2> <dir3> --out <merged>
# (each call's records are under compare/records in its compare_results.tgz).
# Results: $OUT/compare_results.tgz (records run_*.json / status_*.json, compare.md, compare.png,
# every engine's logs, summary), refreshed every 30 s; $OUT/compare.md and $OUT/compare_summary.txt.
set -u
OUT=${OUT:-/tmp/vattn-out}; mkdir -p "$OUT"
W=$(mktemp -d); R=$W/compare; REC=$R/records; mkdir -p "$REC"
SUM=$R/summary.txt; : > "$SUM"
START=$(date +%s); BUDGET=${VATTN_BUDGET_S:-530}
. "$(dirname "$0")/engine_lib.sh"
# the repository as package vattn with every engine's entry points; the engines' own folders go on
# their own interpreter's path only (below)
link_vattn '[vllm.general_plugins]\nvattn = vattn.adapters.vllm.plugin:register\n\n[sglang.srt.plugins]\nvattn = vattn.adapters.sglang.plugin:register\n\n[sglang.srt.platforms]\nvattn = vattn.adapters.sglang.platform:activate\n'
BASE_PATH=$PYTHONPATH
unset VATTN_VLLM VATTN_VLLM_EXACT VATTN_SGLANG   # set per run, for the vattn mode only, by the runners
export VLLM_USE_FLASHINFER_SAMPLER=0

start_packer compare   # pack(): engine_lib.sh

# interpreter ENGINE SITE: a python3 with SITE (may be empty) and the shim on its path
interpreter() {
  local f=$W/python-$1
  printf '#!/bin/sh\nexport PYTHONPATH="%s"\nexec python3 "$@"\n' "$BASE_PATH${2:+:$2}" > "$f"
  chmod +x "$f"; echo "$f"
}
PY_vllm=$(interpreter vllm "${VATTN_VLLM_SITE:-}")
PY_sglang=$(interpreter sglang "${VATTN_SITE:-}")

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
  "$PY_vllm" -W ignore -c 'import vllm; print("vllm", vllm.__version__)'
  "$PY_sglang" -W ignore -c 'import sglang; print("sglang", sglang.__version__)'
} > "$R/env.txt" 2>&1
cat "$R/env.txt" >> "$SUM"

HBM=${VATTN_HBM_TBPS:-$(python3 -c 'from vattn.bench.paged_baselines import hbm_copy_tbps as f; print(round(f("cuda"), 3))' 2>> "$R/env.txt")}
echo "copy bandwidth: ${HBM:-not measured} TB/s" | tee -a "$SUM"

ENGINES=${VATTN_ENGINES:-vllm sglang transformers tgi}
min_s() { case "$1" in vllm|sglang) echo 200 ;; transformers) echo 150 ;; *) echo 20 ;; esac; }
COMMON=(--shape "${VATTN_SHAPE:-llama3-8b-shape}" --workloads "${VATTN_WORKLOADS:-decode-heavy}"
        --rounds "${VATTN_ROUNDS:-3}" --logprobs "${VATTN_LOGPROBS:-5}" --models-dir "$W/models" --out "$REC")
[ -n "${VATTN_LAYERS:-}" ] && COMMON+=(--layers "$VATTN_LAYERS")
[ -n "${VATTN_NUM_REQUESTS:-}" ] && COMMON+=(--num-requests "$VATTN_NUM_REQUESTS")
[ -n "$HBM" ] && COMMON+=(--hbm-tbps "$HBM")
rest=0; for e in $ENGINES; do rest=$((rest + $(min_s "$e"))); done
for e in $ENGINES; do
  rest=$((rest - $(min_s "$e")))
  args=(--engines "$e")
  case "$e" in vllm) args+=(--python "vllm=$PY_vllm") ;; sglang) args+=(--python "sglang=$PY_sglang") ;; esac
  for opt in ${VATTN_ENGINE_OPTIONS:-}; do [ "${opt%%:*}" = "$e" ] && args+=(--engine-option "$opt"); done
  left=$(( BUDGET - ($(date +%s) - START) )); max=$(( left - rest - 10 ))
  [ "$max" -lt "$(min_s "$e")" ] && max=$(min_s "$e")   # then the engines after it may be skipped
  run_stage "compare_$e" "$(min_s "$e")" "$max" python3 -m vattn compare "${args[@]}" "${COMMON[@]}"
done
# every engine's records in one table (an engine that was skipped or killed has none); outside the
# budget: it takes seconds
echo "== merge" | tee -a "$SUM"
timeout 60 python3 -m vattn compare --results "$REC" --out "$REC" > "$R/merge.out" 2>&1
echo "== merge: rc=$?" | tee -a "$SUM"; tail -c 4000 "$R/merge.out" >> "$SUM"
cp "$REC/compare.md" "$OUT/compare.md" 2>/dev/null
echo "== total $(( $(date +%s) - START )) s" | tee -a "$SUM"
pack
