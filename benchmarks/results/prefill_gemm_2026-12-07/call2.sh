#!/usr/bin/env bash
# The second call, on the same warm machine (01:58 UTC): A rebuilt with the grouped products on 128 × 128 tiles
# (gemm_tile), 4K prefill against B again (the *_final.json files), then the decode harness in full.
set -uo pipefail
ROOT=$PWD; OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
log() { echo "== $(date -u +%T) $*"; }
log rebuild
(cmake --build build/dev -j14 > build/lily2.log 2>&1 || tail -20 build/lily2.log) &
(nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 -I csrc benchmarks/cuda/decode_kernels.cu -o build/decode_kernels > "$OUT/dk_build.log" 2>&1 || echo "dk build failed") &
wait
log bench
for r in 1 2; do for n in B A; do
  T=$ROOT; [ $n = B ] && T=/tmp/ab/B
  (cd "$T" && PYTHONPATH=$T/src timeout 100 python3 "$ROOT"/benchmarks/cuda_bench.py --model /tmp/synth-full --lengths 4096 \
     --contexts 128 --decode-tokens 8 --repeats 2 --json "$OUT/bench2_${n}_$r.json" 2>&1 | grep -E "prefill|Error" | sed "s/^/$n r$r /")
done; done
log "decode kernels"
timeout 100 build/decode_kernels > "$OUT/dk.log" 2>&1; grep -v " ok" "$OUT/dk.log" | tail -12; grep -c " ok" "$OUT/dk.log"
log done
