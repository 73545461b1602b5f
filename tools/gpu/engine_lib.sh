# Shared by the GPU scripts (sourced). The caller sets OUT, W (work dir), R (results dir under W),
# SUM (summary file), START and BUDGET (or calls begin_run) and defines pack() (or calls start_packer).

# link_vattn ENTRY_POINTS: put the repository on PYTHONPATH as package `vattn`, with a dist-info
# declaring ENTRY_POINTS (engines find plugins through package metadata, and the repository is
# not installed on the GPU machine)
link_vattn() {
  local site dist
  site=$(mktemp -d); ln -s "$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)" "$site/vattn"
  dist=$site/vattn_gpu_shim-0.dist-info; mkdir -p "$dist"
  printf 'Metadata-Version: 2.1\nName: vattn-gpu-shim\nVersion: 0\n' > "$dist/METADATA"
  printf '%b' "$1" > "$dist/entry_points.txt"
  export PYTHONPATH="$site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
}

# begin_run NAME DEFAULT_BUDGET_S: OUT (default ./vattn-out), a work dir W with results in R=W/NAME,
# the summary file SUM, START and BUDGET (VATTN_BUDGET_S, else DEFAULT_BUDGET_S)
begin_run() {
  OUT=${OUT:-$PWD/vattn-out}; mkdir -p "$OUT"
  W=$(mktemp -d); R=$W/$1; mkdir -p "$R"
  SUM=$R/summary.txt; : > "$SUM"
  START=$(date +%s); BUDGET=${VATTN_BUDGET_S:-$2}
}

# use_engine vllm|sglang: the staged engine on PYTHONPATH (vLLM from VATTN_VLLM_SITE, SGLang from
# VATTN_SITE) and vattn linked in with that engine's plugin entry points
use_engine() {
  case "$1" in
    vllm)
      if [ -n "${VATTN_VLLM_SITE:-}" ]; then export PYTHONPATH="$VATTN_VLLM_SITE:${PYTHONPATH:-}"; fi
      link_vattn '[vllm.general_plugins]\nvattn = vattn.adapters.vllm.plugin:register\n'
      export VLLM_USE_FLASHINFER_SAMPLER=0 ;;
    sglang)
      if [ -n "${VATTN_SITE:-}" ]; then export PYTHONPATH="$VATTN_SITE:${PYTHONPATH:-}"; fi
      link_vattn '[sglang.srt.plugins]\nvattn = vattn.adapters.sglang.plugin:register\n\n[sglang.srt.platforms]\nvattn = vattn.adapters.sglang.platform:activate\n'
      unset VATTN_SGLANG ;;
    *) echo "VATTN_ENGINE must be vllm or sglang, got $1" >&2; return 2 ;;
  esac
}

# run_stage NAME MIN_S MAX_S CMD...: run under `timeout` if at least MIN_S of the budget is left;
# returns the command's exit status (3 when skipped). VATTN_STAGE_DEADLINE lets the command stop
# a sub-run itself before the limit, so it still writes its JSON.
run_stage() {
  local name=$1 min=$2 max=$3; shift 3
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt "$min" ]; then
    echo "== $name: SKIPPED (needs ${min} s, ${left} s of the budget left)" | tee -a "$SUM"; return 3
  fi
  local lim=$(( left < max ? left : max )) t0=$(date +%s)
  echo "== $name (limit ${lim} s)" | tee -a "$SUM"
  VATTN_STAGE_DEADLINE=$(( t0 + lim - 10 )) timeout -k 15 "$lim" "$@" > "$R/$name.out" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $(( $(date +%s) - t0 )) s$([ $rc -eq 124 ] && echo ' (TIMED OUT)')" | tee -a "$SUM"
  tail -c 2500 "$R/$name.out" >> "$SUM"; echo >> "$SUM"
  pack
  return $rc
}

# start_packer NAME: pack() tars $W/NAME to $OUT/NAME_results.tgz and copies $SUM to
# $OUT/NAME_summary.txt, each under a private name first and then renamed, so the background
# packer and a stage's own pack never leave a half-written file; the packer refreshes both every
# 30 s, so a run killed from outside (the device call's own limit) still returns what it has
start_packer() {
  PACK_NAME=$1
  ( n=0; while [ ! -e "$W/stop" ]; do sleep 1; n=$((n + 1)); [ $((n % 30)) -ne 0 ] || pack; done
  ) > /dev/null 2>&1 & PACKER=$!
  trap 'touch "$W/stop"; wait $PACKER 2>/dev/null' EXIT
}
pack() {
  local tmp=$W/pack.$BASHPID.tgz
  tar -czf "$tmp" -C "$W" "$PACK_NAME" 2>/dev/null; mv -f "$tmp" "$OUT/${PACK_NAME}_results.tgz"
  cp "$SUM" "$OUT/${PACK_NAME}_summary.txt.$BASHPID" && mv -f "$OUT/${PACK_NAME}_summary.txt.$BASHPID" "$OUT/${PACK_NAME}_summary.txt"
}
