#!/usr/bin/env bash
# Call 1: this change (A) against HEAD (B: a copy with exp/old.patch applied): both built, the prefill harness
# (A in full, B's GEMM lines), prefill 512 / 4K end to end, B / A / A with expert_swiglu off.
set -uo pipefail
ROOT=$PWD; OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
log() { echo "== $(date -u +%T) $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
rm -rf /tmp/ab/B && mkdir -p /tmp/ab/B
tar --exclude=./build --exclude=./models --exclude=./.peer -cf - . | tar -xf - -C /tmp/ab/B
(cd /tmp/ab/B && patch -p1 -s < "$ROOT/exp/old.patch") || { echo "old patch failed"; exit 1; }
log build
(PYTHONPATH=$ROOT/src python3 -m lily.cli synth --scale full --out /tmp/synth-full > "$OUT/synth.log" 2>&1 || tail -5 "$OUT/synth.log"; log "synth done") &
for T in "$ROOT" /tmp/ab/B; do
  (cd "$T" && mkdir -p build && nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 -I csrc \
     benchmarks/cuda/prefill_kernels.cu -o build/prefill_kernels > build/pk.log 2>&1 || { echo "$T pk build failed"; tail -5 build/pk.log; }) &
  (cd "$T" && cmake -S . -B build/dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python3)" \
      -DLILY_METAL_EMU=OFF > build/lily.log 2>&1 && cmake --build build/dev -j8 >> build/lily.log 2>&1 && ln -sf "$T"/build/dev/_core*.so src/lily/ \
      || { echo "$T lily build failed"; tail -30 build/lily.log; }) &
done
wait
log "prefill kernels A"
timeout 170 build/prefill_kernels > "$OUT/pk_A.log" 2>&1; grep -v " ok  $" "$OUT/pk_A.log" | grep -v "^ *(vs exact" | head -70
bench() {  # round, builds...
  local r=$1; shift
  for n in "$@"; do
    T=$ROOT; EXTRA=(); [ $n = B ] && T=/tmp/ab/B; [ $n = Aoff ] && EXTRA=(--fusions-off expert_swiglu)
    (cd "$T" && PYTHONPATH=$T/src timeout 100 python3 "$ROOT"/benchmarks/cuda_bench.py --model /tmp/synth-full --lengths 512,4096 \
       --contexts 128 --decode-tokens 8 --repeats 2 "${EXTRA[@]}" --json "$OUT/bench_${n}_$r.json" 2>&1 | grep -E "prefill|Error" | sed "s/^/$n r$r /")
  done
}
log bench
bench 1 B A Aoff
log "prefill kernels B (gemm)"
timeout 120 /tmp/ab/B/build/prefill_kernels > "$OUT/pk_B.log" 2>&1; grep -E "TFLOP|FAIL|passed" "$OUT/pk_B.log" | grep -E "gemm|FAIL|passed" | head -40
log done
