#!/bin/bash
# A shorter device call than cuda_h200_run.sh, for comparing decode variants on one machine: lily built, the
# decode kernel harness (its passes for two decode blocks an SM and for one), the CUDA tests, then decode on the
# full-size synthetic checkpoint once per LILY_CUDA_DECODE_BLOCKS_PER_SM value in PER_SM (default "2 1"), each
# with its JSON. Run from the root of a copy of the repository, with $OUT set and
# $LILY_TEST_MODELS carried (without it the tests are left out).
set -u
cd "$(dirname "$0")/.."
T0=$(date +%s)
el() { echo "== +$(( $(date +%s) - T0 )) s $*"; }
mkdir -p "$OUT/extra"
el "build + decode kernels"
STEPS="build decode" bash benchmarks/cuda_device.sh > "$OUT/extra/stage1.txt" 2>&1
mv "$OUT/logs.tar.gz" "$OUT/extra/logs_build_kernels.tar.gz" 2>/dev/null
grep -E "FAIL|passed|ERROR SUMMARY|error|time |step|-- decode" "$OUT/extra/stage1.txt" | tail -${HARNESS_LINES:-40}
el "synth (background) + tests"
PYTHONPATH=src python3 -m lily.cli synth --scale full --out /tmp/synth-full > "$OUT/extra/synth.log" 2>&1 &
SYNTH=$!
if [ -n "${LILY_TEST_MODELS:-}" ]; then  # the tiny models (built where mlx is) carried; else no tests
  STEPS="test" bash benchmarks/cuda_device.sh 2>&1 | grep -v "^PASSED" | tail -${TEST_LINES:-20}
  mv "$OUT/logs.tar.gz" "$OUT/extra/logs_tests.tar.gz" 2>/dev/null
fi
wait $SYNTH
for n in ${PER_SM:-2 1}; do
  el "decode, $n blocks an SM"
  LILY_CUDA_DECODE_BLOCKS_PER_SM=$n PYTHONPATH=src timeout 240 python3 benchmarks/cuda_bench.py --model /tmp/synth-full \
    --lengths ${LENGTHS:-4096} --contexts ${CONTEXTS:-128,4096} --decode-tokens 64 --repeats 3 \
    --json "$OUT/decode_per_sm$n.json" 2>&1 | grep -E "decode|prefill" | tail -8
done
tar czf "$OUT/extra.tgz" -C "$OUT" extra && rm -rf "$OUT/extra"
el done
