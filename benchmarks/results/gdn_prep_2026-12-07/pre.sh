#!/usr/bin/env bash
# PRE of benchmarks/cuda_h200_run.sh (call.sh): the prefill harness's GDN cases, this tree (the packs on the
# tensor cores) against the tree before it (exp/before.patch: `git diff -R -- csrc` of the change), alternating,
# twice each. When this tree's cases fail, exp/before.patch is applied, so that the tests and benchmarks after it
# measure the tree before.
set -u
OUT=$OUT/extra WHAT=gdn bash benchmarks/cuda_ab.sh before=exp/before.patch
if ! grep -q "all passed" "$OUT/extra/ab_gdn_A_1.log"; then
  echo "this tree's GDN cases FAILED: the tree before is put back for the rest of the call"
  head -40 "$OUT/extra/ab_gdn_A_1.log"
  patch -p1 -s < exp/before.patch
fi
