#!/usr/bin/env bash
# A/B in one device call: this tree (A) against variants of it, each this tree with a patch applied (`git diff`
# output, carried with the call). Every build's lily._core and the harnesses WHAT needs are built side by side;
# then, ROUNDS times, alternating the builds, each in its own process:
#   step     the decode harness's step chain (decode_kernels --step: the GDN layer's projections and experts,
#            40 layers, lm_head)
#   decode   greedy decode on synthetic:full (benchmarks/cuda_ab.py, whose token checksums must match across builds)
#   gdn      the prefill harness's GDN cases (prefill_kernels --gdn: checked against the fp64 host scan, timed)
#   gemm     the prefill harness's products (prefill_kernels --gemm: checked against the reference, timed at the
#            model's shapes, every tile)
#   prefill  prefill of LENGTHS tokens on synthetic:full (benchmarks/cuda_bench.py, JSON to $OUT/ab_prefill_*.json)
# Run from the tree's root:
#
#   OUT=$OUT bash benchmarks/cuda_ab.sh name=exp/change.patch [name2=exp/other.patch ...]
#
# ROUNDS (2); CONTEXTS (128,4096); LENGTHS (512,4096); WHAT ("step decode"). The copies go to /tmp/ab/<name>;
# lily itself is built only for decode and prefill. Every line printed also goes to $OUT/ab_summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/cuda_builds.sh  # build_core, build_harness
ROOT=$PWD
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
# every line also into $OUT/ab_summary.txt: a device call returns only its output's tail, and an A/B of several
# builds prints more than that (the night of 2026-12-07 lost a build's lines so)
exec > >(tee -a "$OUT/ab_summary.txt") 2>&1
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
  # (not A's lily._core link: a copy whose build failed must not load A's)
  tar --exclude=./build --exclude=./models --exclude=./.peer --exclude='./src/lily/_core*' -cf - . |
    tar -xf - -C "/tmp/ab/$name"
  (cd "/tmp/ab/$name" && patch -p1 -s <"$patch") || { echo "$name: $patch does not apply"; exit 1; }
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
log "build ${NAMES[*]}"
jobs=$(( 16 / ${#NAMES[@]} > 2 ? 16 / ${#NAMES[@]} : 2 ))
for n in "${NAMES[@]}"; do
  for h in decode prefill; do
    if { [ $h = decode ] && has step; } || { [ $h = prefill ] && { has gdn || has gemm; }; }; then
      (cd "${TREE[$n]}" && mkdir -p build &&
        build_harness $h build/${h}_kernels >"$OUT/ab_${h}_harness_$n.log" 2>&1 || echo "$n: $h harness build failed") &
    fi
  done
  { has decode || has prefill; } && (cd "${TREE[$n]}" &&
    build_core "$(command -v python3)" build/dev "$jobs" >"$OUT/ab_build_$n.log" 2>&1 && ln -sf "${TREE[$n]}"/build/dev/_core*.so src/lily/ ||
    { echo "$n: lily build failed"; tail -20 "$OUT/ab_build_$n.log"; }
    # the checkpoint, once A's lily._core is there (lily.cli imports it), while the other builds go on
    if [ "$n" = A ] && [ ! -d /tmp/synth-full ]; then
      log "synth full"
      PYTHONPATH=$ROOT/src python3 -m lily.cli synth --scale full --out /tmp/synth-full >"$OUT/ab_synth.log" 2>&1 ||
        tail -5 "$OUT/ab_synth.log"
    fi) &
done
wait $(jobs -p)  # (the builds: a bare wait would also wait for the tee above, which waits for this script)
for r in $(seq 1 "${ROUNDS:-2}"); do
  for n in "${NAMES[@]}"; do
    if has step; then
      echo "step $n round $r: $("${TREE[$n]}"/build/decode_kernels --step 2>&1 | awk '/^step/ {printf "%s ", $(NF-5)}') us"
    fi
    if has decode; then
      (cd "${TREE[$n]}" && PYTHONPATH=${TREE[$n]}/src timeout 150 python3 "$ROOT"/benchmarks/cuda_ab.py \
        --model /tmp/synth-full --tag "$n" --contexts "${CONTEXTS:-128,4096}" 2>&1 | grep -E "^ab|^turn|Error" | tail -6)
    fi
    if has gdn; then
      timeout 60 "${TREE[$n]}"/build/prefill_kernels --gdn >"$OUT/ab_gdn_${n}_$r.log" 2>&1
      grep -E " ms|of which|FAIL|passed" "$OUT/ab_gdn_${n}_$r.log" | sed "s/^/gdn $n round $r: /"
    fi
    if has gemm; then
      timeout 150 "${TREE[$n]}"/build/prefill_kernels --gemm >"$OUT/ab_gemm_${n}_$r.log" 2>&1
      grep -E "TFLOP|FAIL|passed" "$OUT/ab_gemm_${n}_$r.log" | grep -v "^ " | sed "s/^/gemm $n round $r: /"
    fi
    if has prefill; then  # (cuda_bench.py also times decode: the shortest it allows)
      (cd "${TREE[$n]}" && PYTHONPATH=${TREE[$n]}/src timeout 90 python3 "$ROOT"/benchmarks/cuda_bench.py \
        --model /tmp/synth-full --lengths "${LENGTHS:-512,4096}" --contexts 128 --decode-tokens 8 --repeats 2 \
        --json "$OUT/ab_prefill_${n}_$r.json" 2>&1 | grep -E "^prefill|Error" | sed "s/^/$n round $r: /")
    fi
  done
done
log done
