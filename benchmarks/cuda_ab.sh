#!/usr/bin/env bash
# A/B in one device call: this tree (A) against variants of it, each this tree with a patch applied (`git diff`
# output, carried with the call). Every build's lily._core and decode harness are built side by side; then,
# ROUNDS times, alternating the builds, each in its own process: the harness's step chain (decode_kernels
# --step: the GDN layer's projections and experts, 40 layers, lm_head) and greedy decode on synthetic:full
# (benchmarks/cuda_ab.py, whose token checksums must match across builds). Run from the tree's root:
#
#   OUT=$OUT bash benchmarks/cuda_ab.sh name=exp/change.patch [name2=exp/other.patch ...]
#
# ROUNDS (2); CONTEXTS (128,4096); WHAT ("step decode": either or both). The copies go to /tmp/ab/<name>.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
WHAT=${WHAT:-step decode}
has() { [[ " $WHAT " == *" $1 "* ]]; }
log() { echo "== $(date -u +%T) $*"; }
declare -A TREE=([A]=$ROOT)
NAMES=(A)
for arg in "$@"; do
  name=${arg%%=*} patch=$ROOT/${arg#*=}
  [ -f "$patch" ] || { echo "no patch $patch"; exit 1; }
  TREE[$name]=/tmp/ab/$name
  NAMES+=("$name")
  rm -rf "/tmp/ab/$name" && mkdir -p "/tmp/ab/$name"
  tar --exclude=./build --exclude=./models --exclude=./.peer -cf - . | tar -xf - -C "/tmp/ab/$name"
  (cd "/tmp/ab/$name" && patch -p1 -s <"$patch") || { echo "$name: $patch does not apply"; exit 1; }
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
log "build ${NAMES[*]}"
jobs=$(( 16 / ${#NAMES[@]} > 2 ? 16 / ${#NAMES[@]} : 2 ))
for n in "${NAMES[@]}"; do
  (cd "${TREE[$n]}" && mkdir -p build &&
    nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 -I csrc benchmarks/cuda/decode_kernels.cu \
      -o build/decode_kernels >"$OUT/ab_harness_$n.log" 2>&1 || echo "$n: harness build failed") &
  (cd "${TREE[$n]}" && cmake -S . -B build/dev -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DPython_EXECUTABLE="$(command -v python3)" -DLILY_METAL_EMU=OFF >"$OUT/ab_build_$n.log" 2>&1 &&
    cmake --build build/dev -j"$jobs" >>"$OUT/ab_build_$n.log" 2>&1 && ln -sf "${TREE[$n]}"/build/dev/_core*.so src/lily/ ||
    { echo "$n: lily build failed"; tail -20 "$OUT/ab_build_$n.log"; }
    # the checkpoint, once A's lily._core is there (lily.cli imports it), while the other builds go on
    if [ "$n" = A ] && has decode && [ ! -d /tmp/synth-full ]; then
      log "synth full"
      PYTHONPATH=$ROOT/src python3 -m lily.cli synth --scale full --out /tmp/synth-full >"$OUT/ab_synth.log" 2>&1 ||
        tail -5 "$OUT/ab_synth.log"
    fi) &
done
wait
for r in $(seq 1 "${ROUNDS:-2}"); do
  for n in "${NAMES[@]}"; do
    if has step; then
      echo "step $n round $r: $("${TREE[$n]}"/build/decode_kernels --step 2>&1 | awk '/^step/ {printf "%s ", $(NF-5)}') us"
    fi
    if has decode; then
      (cd "${TREE[$n]}" && PYTHONPATH=${TREE[$n]}/src timeout 150 python3 "$ROOT"/benchmarks/cuda_ab.py \
        --model /tmp/synth-full --tag "$n" --contexts "${CONTEXTS:-128,4096}" 2>&1 | grep -E "^ab|^turn|Error" | tail -6)
    fi
  done
done
log done
