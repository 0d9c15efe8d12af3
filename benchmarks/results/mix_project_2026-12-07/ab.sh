#!/usr/bin/env bash
# Greedy decode at 4K with Fusions::mix_project on and off in one build (cuda_ab.py --fusions), alternating,
# ROUNDS rounds, into $OUT/ab.txt. From the tree's root on a device machine; builds lily and the full-size
# checkpoint first where they are not there (~3 min), else ~2 min a round.
# Ran on 9d1a15c, where the switch existed (2026-12-08, H100): ab.txt / bytes_{on,off}.json. The fusion lost
# (408 against 530 tok/s) and was taken out of the tree afterwards, so these scripts need a checkout of 9d1a15c.
set -u
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
