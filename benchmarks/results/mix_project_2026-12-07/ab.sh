#!/usr/bin/env bash
# After call.sh beside it (see there): greedy decode at 4K with Fusions::mix_project on and off in the same build,
# alternating, ROUNDS rounds (~4 min on the warm machine call.sh used; on a fresh one it first applies the patch,
# builds lily and the full-size checkpoint, ~3 min more).
set -u
if ! grep -q mix_project csrc/schedule/backend.h; then
  patch -p1 -s < benchmarks/results/mix_project_2026-12-07/mix_project.patch || { echo "the patch does not apply"; exit 1; }
fi
ls src/lily/_core*.so >/dev/null 2>&1 || STEPS=build bash benchmarks/cuda_device.sh 2>&1 | tail -3
if [ ! -f /tmp/synth-full/.complete ]; then
  rm -rf /tmp/synth-full
  PYTHONPATH=src python3 -m lily.cli synth --scale full --out /tmp/synth-full | tail -1 && touch /tmp/synth-full/.complete
fi
for r in $(seq 1 "${ROUNDS:-2}"); do
  for v in on off; do
    f=; [ $v = off ] && f=mix_project
    PYTHONPATH=src timeout 100 python3 benchmarks/cuda_ab.py --model /tmp/synth-full --tag "mix_project_$v" \
      --contexts 4096 --fusions "$f" 2>&1 | grep -E "^ab|^turn|Error" | sed "s/^/round $r: /" | tee -a "$OUT/ab.txt"
  done
done
