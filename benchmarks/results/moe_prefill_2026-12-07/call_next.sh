#!/usr/bin/env bash
# One call on a fresh machine: this change (A) against 0941213 (B: a copy of the tree with exp/old.patch
# applied, made beforehand by `git diff HEAD 0941213 -- csrc benchmarks/cuda`), both built; the CUDA tests on A
# while the synthetic checkpoint is written; prefill 512 / 4K in alternating processes B, A, A with expert_swiglu
# off; the prefill harness of A with the time left.
set -uo pipefail
ROOT=$PWD; OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
log() { echo "== $(date -u +%T) $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
rm -rf /tmp/ab/B && mkdir -p /tmp/ab/B
tar --exclude=./build --exclude=./models --exclude=./.peer -cf - . | tar -xf - -C /tmp/ab/B
(cd /tmp/ab/B && patch -p1 -s < "$ROOT/exp/old.patch") || { echo "old patch failed"; exit 1; }
log build
mkdir -p build /tmp/ab/B/build
(nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 -I csrc benchmarks/cuda/prefill_kernels.cu \
   -o build/prefill_kernels > build/pk.log 2>&1 || { echo "pk build failed"; tail -5 build/pk.log; }) &
for T in "$ROOT" /tmp/ab/B; do
  (cd "$T" && cmake -S . -B build/dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python3)" \
      -DLILY_METAL_EMU=OFF > build/lily.log 2>&1 && cmake --build build/dev -j7 >> build/lily.log 2>&1 && ln -sf "$T"/build/dev/_core*.so src/lily/ \
      || { echo "$T lily build failed"; tail -30 build/lily.log; }) &
done
wait
log "synth (background) and the CUDA tests on A"
(PYTHONPATH=$ROOT/src python3 -m lily.cli synth --scale full --out /tmp/synth-full > "$OUT/synth.log" 2>&1 || tail -5 "$OUT/synth.log"; log "synth done") &
for d in "$ROOT"/models/*/*/*/; do [ -f "$d/config.json" ] && touch "$d/.complete"; done
LILY_TEST_MODELS=$ROOT/models STEPS=test timeout 200 bash benchmarks/cuda_device.sh 2>&1 | tail -25
wait
bench() {
  local r=$1; shift
  for n in "$@"; do
    T=$ROOT; EXTRA=(); [ $n = B ] && T=/tmp/ab/B; [ $n = Aoff ] && EXTRA=(--fusions-off expert_swiglu)
    (cd "$T" && PYTHONPATH=$T/src timeout 100 python3 "$ROOT"/benchmarks/cuda_bench.py --model /tmp/synth-full --lengths 512,4096 \
       --contexts 128 --decode-tokens 8 --repeats 2 "${EXTRA[@]}" --json "$OUT/bench_${n}_$r.json" 2>&1 | grep -E "prefill|Error" | sed "s/^/$n r$r /")
    r=$((r + 1))
  done
}
log bench
bench 1 B A Aoff
log "prefill kernels A"
LEFT=$(( 290 - SECONDS )); [ $LEFT -gt 30 ] && timeout $LEFT build/prefill_kernels > "$OUT/pk_A.log" 2>&1; grep -E "FAIL|passed|takes" "$OUT/pk_A.log" | tail -30
log done
