# As run at 23:50 UTC from the repository root, the patches then in exp/: p1 = topk_tree_down8.patch and p2 =
# topk_tree_down8_dry_down.patch (beside this file; point the paths below at them to run it again).
set -uo pipefail
export PATH=$PATH:/usr/local/cuda/bin
ROOT=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
for v in A p1 p2; do
  rm -rf /tmp/v/$v && mkdir -p /tmp/v/$v && cp -r csrc benchmarks /tmp/v/$v/
  [ $v != A ] && (cd /tmp/v/$v && patch -p1 -s < $ROOT/exp/$v.patch)
  (cd /tmp/v/$v && nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 -I csrc benchmarks/cuda/decode_kernels.cu -o dk > b.log 2>&1 || tail b.log) &
done
wait
date -u +%T
for v in p1 p2; do echo "$v small: $(timeout 60 /tmp/v/$v/dk --small 2>&1 | tee $OUT/${v}_small.log | grep -c FAIL) FAIL lines of $(wc -l < $OUT/${v}_small.log)"; done
grep -E "^route" $OUT/p1_small.log | head -4
for r in 1 2; do for v in A p1 p2; do echo "step $v $r: $(timeout 60 /tmp/v/$v/dk --step 2>&1 | awk '/^step/ {printf "%s ", $(NF-5)}')"; done; done
date -u +%T
timeout 90 /tmp/v/p1/dk 2>&1 | tee $OUT/p1_full.log | grep -E "^(route|h|down|weights|experts).*H 2048|FAIL" | head
