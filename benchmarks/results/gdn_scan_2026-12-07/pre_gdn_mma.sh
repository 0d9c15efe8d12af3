#!/usr/bin/env bash
# PRE of benchmarks/cuda_h200_run.sh (call_full.sh): the prefill harness of this tree (the chunked GDN scan's
# products on the tensor cores, 3xTF32) and of 53556b8's scan (exp/gdn_chunked_head.cuh: the same pipeline, the
# products on the CUDA cores), built side by side; their GDN cases alternating, twice each. When this tree's
# cases fail, 53556b8's scan goes back into csrc/, so that the tests and benchmarks after it measure that one.
set -u
log() { echo "== $(date -u +%T) $*"; }
mkdir -p build "$OUT/extra" && rm -rf /tmp/pk_old && mkdir -p /tmp/pk_old && cp -r csrc /tmp/pk_old/
cp exp/gdn_chunked_head.cuh /tmp/pk_old/csrc/backends/cuda/gdn_chunked.cuh
for v in new old; do
  INC=csrc; [ $v = old ] && INC=/tmp/pk_old/csrc
  (nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 -I $INC benchmarks/cuda/prefill_kernels.cu \
     -o build/pk_$v > "$OUT/extra/pk_${v}_build.log" 2>&1 || { echo "pk $v build failed"; tail -5 "$OUT/extra/pk_${v}_build.log"; }) &
done
wait
log "GDN cases: 53556b8's scan (old), this tree's (new), alternating"
for r in 1 2; do
  for v in old new; do
    timeout 60 build/pk_$v --gdn > "$OUT/extra/gdn_mma_${v}_$r.log" 2>&1
    grep -E " ms|of which|FAIL|passed" "$OUT/extra/gdn_mma_${v}_$r.log" | sed "s/^/$v r$r /"
  done
done
if ! grep -q "all passed" "$OUT/extra/gdn_mma_new_1.log"; then
  echo "this tree's scan FAILED its cases: 53556b8's scan put back for the rest of the call"
  head -40 "$OUT/extra/gdn_mma_new_1.log"
  cp exp/gdn_chunked_head.cuh csrc/backends/cuda/gdn_chunked.cuh
fi
