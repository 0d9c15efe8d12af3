#!/usr/bin/env bash
# Where mix_project's loss goes (ab.txt: 408 against 530 tok/s at 4K on an H100): each kernel of a decode step
# alone, its time and DRAM bytes (cuda_bytes.py, Nsight Compute), with the fusion on and off, into
# $OUT/bytes_{on,off}.json. From the tree's root on a device machine; builds lily and /tmp/synth-full where absent.
# Ran on 9d1a15c, where the switch existed (2026-12-08, H100), with cuda_bytes.py's --fusions then taking JSON
# (it now takes the names switched off, as cuda_ab.py does). The fusion lost and was taken out afterwards.
set -u
ls src/lily/_core*.so >/dev/null 2>&1 || STEPS=build bash benchmarks/cuda_device.sh 2>&1 | tail -3
if [ ! -f /tmp/synth-full/.complete ]; then
  rm -rf /tmp/synth-full
  PYTHONPATH=src python3 -m lily.cli synth --scale full --out /tmp/synth-full | tail -1 && touch /tmp/synth-full/.complete
fi
for v in on off; do
  echo "== mix_project $v"
  PYTHONPATH=src timeout 150 python3 benchmarks/cuda_bytes.py --model /tmp/synth-full --json "$OUT/bytes_$v.json" \
    --fusions "{\"mix_project\": $([ $v = on ] && echo true || echo false)}" 2>&1 | tail -12
done
