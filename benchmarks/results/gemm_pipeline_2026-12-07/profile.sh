set -u
mkdir -p build
nvidia-smi --query-gpu=name --format=csv,noheader
[ -x build/pk ] || nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 -I csrc -lineinfo benchmarks/cuda/prefill_kernels.cu -o build/pk > $OUT/pk_build.log 2>&1 || tail $OUT/pk_build.log
timeout 200 ncu --kernel-name-base demangled -k "regex:gemm_mma_kernel<\(int\)0, \(int\)128, \(int\)(96|128)>" --launch-count 6 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
  --section Occupancy --section ComputeWorkloadAnalysis --section SourceCounters build/pk --experts-once > $OUT/ncu_experts.txt 2>&1
tail -3 $OUT/ncu_experts.txt; wc -l $OUT/ncu_experts.txt
grep -E "gemm_mma_kernel|Duration|Stall|Warp Cycles Per Issued|Issued Warp|Eligible|Compute \(SM\) Th|Memory Th|No Eligible" $OUT/ncu_experts.txt | head -60
