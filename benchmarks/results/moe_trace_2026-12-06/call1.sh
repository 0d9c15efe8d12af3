set -uo pipefail
export PATH=$PATH:/usr/local/cuda/bin
mkdir -p build
nvidia-smi --query-gpu=name --format=csv,noheader
nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 -I csrc -DLILY_DECODE_TRACE benchmarks/cuda/decode_kernels.cu -o build/decode_trace > $OUT/b1.log 2>&1 &
nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 -lineinfo -I csrc benchmarks/cuda/decode_kernels.cu -o build/decode_kernels > $OUT/b2.log 2>&1
wait
for i in 1 2; do timeout 120 build/decode_trace --trace 2>&1 | grep -E "^step|^trace"; done
build/decode_kernels --step 2>&1 | grep ^step
cuobjdump -sass build/decode_kernels > /tmp/sass.txt; python3 - <<'PY'
import re
cur=None; n={}
for l in open('/tmp/sass.txt'):
    m=re.match(r'\s+Function : (\S+)',l)
    if m: cur=m.group(1); n[cur]=0; continue
    if cur and re.match(r'\s+/\*[0-9a-f]{4}\*/',l): n[cur]+=1
for k,v in sorted(n.items(), key=lambda kv:-kv[1])[:12]: print(v*16//1024,'KB',k[:110])
PY
timeout 300 ncu --clock-control none -k regex:moe_decode_kernel --section WarpStateStats --section InstructionStats --section SchedulerStats --section SpeedOfLight --section SourceCounters build/decode_kernels --profile > $OUT/ncu_moe.log 2>&1
grep -vE "^==PROF==" $OUT/ncu_moe.log | grep -iE "stall|Duration|Instructions|Issued|No Eligible|Active Warps|Eligible|Warp Cycles|moe_decode|Branch|smsp" | head -60
