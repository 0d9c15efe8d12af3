#!/usr/bin/env bash
# What a fresh device machine would otherwise build on its clock, built here into .prebuilt/ (ignored; carry it:
# `carry: [".prebuilt"]`): lily._core with the CUDA backend (~135 s there) and the two CUDA harnesses (decode and
# prefill kernels, ~45 s each). This machine has the same nvcc (13.0), and compiling needs no GPU. The device's
# python3 is 3.12, so the module is built against a Python 3.12 (PY312, default pyenv's). .prebuilt/sources holds
# the tree's hash (cuda_builds.sh): cuda_device.sh takes an item only where the tree it runs in hashes the same (and
# the module only where it imports), else it builds as before.
#
#   bash benchmarks/cuda_prebuild.sh        # ~2-3 min on two cores; 4.5 MB gzipped of the 64 MiB a call carries
set -euo pipefail
cd "$(dirname "$0")/.."
PY312=${PY312:-$(ls -d /root/.pyenv/versions/3.12.*/bin/python3 2>/dev/null | tail -1)}
[ -x "$PY312" ] || { echo "no Python 3.12 (set PY312)" >&2; exit 1; }
"$PY312" -c "import nanobind" 2>/dev/null || "$PY312" -m pip install -q "nanobind>=2.4"
source benchmarks/cuda_builds.sh
B=build/device_py312
build_core "$PY312" $B "$(nproc)" >/tmp/lily_prebuild.log 2>&1 || { tail -30 /tmp/lily_prebuild.log; exit 1; }
grep -q "CUDA backend built" /tmp/lily_prebuild.log || { echo "no CUDA compiler: nothing to prebuild" >&2; exit 1; }
for h in decode prefill; do build_harness $h "$B/${h}_kernels"; done
rm -rf .prebuilt && mkdir .prebuilt
so=$(cd $B && ls _core*.so)
for f in "$so" decode_kernels prefill_kernels; do gzip -c "$B/$f" >".prebuilt/$f.gz"; done
prebuilt_hash >.prebuilt/sources
echo "sources $(cat .prebuilt/sources):"
du -h .prebuilt/*.gz
