#!/usr/bin/env bash
# vLLM on one GPU: stock paged (FLASH_ATTN) vs one block per request (ceiling) vs vattn (CUSTOM).
# Needs vLLM 0.26.0 importable (e.g. staged into a directory on PYTHONPATH: VATTN_VLLM_SITE).
# Writes $OUT/vllm_<workload>_<mode>.json and $OUT/vllm_summary.txt. About 8 minutes.
# The vattn GPU path is not implemented yet: its runs are expected to fail with UnsupportedError,
# which is recorded in the summary (the stock and ceiling columns are still measured).
set -u
OUT=${OUT:-/tmp/vattn-out}
mkdir -p "$OUT"
if [ -n "${VATTN_VLLM_SITE:-}" ]; then export PYTHONPATH="$VATTN_VLLM_SITE:${PYTHONPATH:-}"; fi
# the repository root is the package `vattn`: expose it under that name
PKG=$(mktemp -d); ln -s "$(cd "$(dirname "$0")/../.." && pwd)" "$PKG/vattn"
export PYTHONPATH="$PKG:${PYTHONPATH:-}"
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ALLOW_LONG_MAX_MODEL_LEN=1
# usage: tools/gpu/vllm.sh [identity] [decode-heavy] [prefill-heavy] [long-context]  (default: all)
python3 - "$OUT" "$@" <<'PY'
import json, random, sys
out, wanted = sys.argv[1], sys.argv[2:]
from vattn.conformance.models import build_model
from vattn.adapters.vllm.conformance import VllmRunner
model = build_model("llama3-8b-shape", "/tmp/vattn-llama8b", seed=0, dtype="bfloat16", device="cuda")
rng = random.Random(0)
def prompts(n, plen):
    return [[rng.randrange(10, 120000) for _ in range(plen)] for _ in range(n)]
workloads = {  # name -> (prompts, new tokens, max_num_seqs); sized to ~8 minutes in total
    "identity": (prompts(16, 200), 32, 16),
    "decode-heavy": (prompts(256, 512), 512, 256),
    "prefill-heavy": (prompts(32, 16384), 64, 32),
    "long-context": (prompts(8, 65536), 64, 8),
}
lines = []
for name, (ps, new, seqs) in workloads.items():
    if wanted and name not in wanted:
        continue
    runner = VllmRunner(device="cuda", max_num_seqs=seqs, timeout_s=600)
    results = {}
    for mode in runner.modes:
        try:
            res = runner.run(mode, model, ps, new, logprobs=5 if name == "identity" else 0,
                             device="cuda", dtype="bfloat16")
            results[mode] = res
            json.dump(res.__dict__, open(f"{out}/vllm_{name}_{mode}.json", "w"))
            lines.append(f"{name} {mode}: {res.seconds:.2f}s gen_tok/s={res.num_generated_tokens/res.seconds:.0f}")
        except Exception as exc:  # report and go on: one failing mode must not hide the others
            lines.append(f"{name} {mode}: FAILED {type(exc).__name__}: {str(exc)[-400:]}")
        print(lines[-1], flush=True)
    if name == "identity" and "stock" in results:
        for mode in ("ceiling", "vattn"):
            if mode in results:
                same = results[mode].token_ids == results["stock"].token_ids
                lines.append(f"identity {mode} vs stock: exact={same}")
                print(lines[-1], flush=True)
open(f"{out}/vllm_summary.txt", "a").write("\n".join(lines) + "\n")
PY
