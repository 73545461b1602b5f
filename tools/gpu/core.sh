#!/usr/bin/env bash
# GPU checks of vattn.core on one CUDA GPU (~3 minutes). Run from the repository root:
#   OUT=/some/dir bash tools/gpu/core.sh
# Writes under $OUT: core_tests.txt, sanitizer.txt, vmm_busy.json, vmm.json, BENCHMARKS.md.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
SITE=$(mktemp -d)
ln -s "$(pwd)" "$SITE/vattn"                     # the repo root is the package vattn
export PYTHONPATH="$SITE:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

echo "== vattn info"
$PY -m vattn info | tee "$OUT/info.txt"
echo "== bench vmm --busy-only (do VMM calls wait for the kernels in flight?)"
timeout 120 $PY -m vattn bench vmm --device cuda --busy-only --json "$OUT/vmm_busy.json" 2>&1 | tail -18
echo "== core tests on CUDA (-m gpu) and host"
timeout 240 $PY -m pytest -q -m "gpu or not gpu" tests/core/test_driver.py tests/core/test_cache.py \
  tests/core/test_layout.py tests/core/test_faults.py tests/core/test_retire.py -p no:cacheprovider -x > "$OUT/core_tests.txt" 2>&1
tail -4 "$OUT/core_tests.txt"
echo "== compute-sanitizer memcheck on the CUDA churn test"
timeout 240 compute-sanitizer --tool memcheck --leak-check no --report-api-errors no $PY -m pytest -q -p no:cacheprovider \
  "tests/core/test_cache.py::test_churn_under_map_ahead_reads_back_exactly[cuda]" \
  "tests/core/test_cache.py::test_views_read_back_what_was_written_across_pages[cuda]" \
  "tests/core/test_retire.py::test_on_cuda_a_kernel_in_flight_reads_the_old_mapping_while_its_pages_serve_another" \
  > "$OUT/sanitizer.txt" 2>&1
grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitizer.txt" | tail -3
echo "== bench vmm"
timeout 200 $PY -m vattn bench vmm --device cuda --busy-ms 0 --json "$OUT/vmm.json" 2>&1 | grep -v "^{" | tail -22
cp BENCHMARKS.md "$OUT/" 2>/dev/null || true
