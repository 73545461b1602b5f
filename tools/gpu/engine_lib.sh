# Shared by tools/gpu/vllm.sh and tools/gpu/sglang.sh (sourced). The caller sets OUT, W (work dir),
# R (results dir under W), SUM (summary file), START, BUDGET and defines pack().

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
