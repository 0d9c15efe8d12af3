#!/usr/bin/env bash
# A PRE of benchmarks/cuda_h200_run.sh: a harness A/B of this tree against the tree before a change, before the
# call's tests and benchmarks. AB_BEFORE: the change reversed (`git diff -R -- csrc > exp/before.patch`, carried
# with the call); AB_WHAT: cuda_ab.sh's checking harness steps (gdn, gemm). When this tree fails a harness case,
# AB_BEFORE is applied, so that the rest of the call measures the tree before the change.
#
#   AB_WHAT=gemm AB_BEFORE=exp/before.patch PRE=benchmarks/cuda_ab_pre.sh bash benchmarks/cuda_h200_run.sh
set -u
OUT=$OUT/extra WHAT=$AB_WHAT bash benchmarks/cuda_ab.sh before="$AB_BEFORE"
ok=1
for w in $AB_WHAT; do grep -q "all passed" "$OUT/extra/ab_${w}_A_1.log" 2>/dev/null || ok=0; done
if [ $ok = 0 ]; then
  echo "this tree FAILED a harness case: $AB_BEFORE is applied for the rest of the call"
  grep -h "FAIL" "$OUT"/extra/ab_*_A_1.log | head -20
  patch -p1 -s < "$AB_BEFORE"
fi
