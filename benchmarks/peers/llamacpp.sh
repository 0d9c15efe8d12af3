#!/bin/bash
# llama.cpp (CUDA, flash attention) as the issue-14 peer on the device, on a random-weight GGUF of the
# Qwen3.6-35B-A3B geometry in a Q4_K_M mix.
#
#   peer.sh start   launch the llama-bench build and the GGUF generation in the background; returns at once
#                   so both overlap with whatever the caller runs next in the same device call
#   peer.sh bench   wait for both, run llama-bench, write llama_bench.json (llama-bench's own) and llama_bench.md
#                   (its table, the environment, the end of the build and generation logs) to $OUT
#
# Everything stops by PEER_DEADLINE (epoch seconds; default: 540 s after `start`), whatever happens, so the
# device call ends inside its limit. The jobs run in their own sessions: on a machine kept warm, `bench` may
# come in the next device call (give it PEER_DEADLINE there too; the build keeps the deadline of its `start`).
# The build and the model go to PEER_WORK (default /tmp/lily-peer, local disk on the device, outside the
# carried tree; the model takes 21 GB). The background jobs run at nice 19 so they take only the cores the
# caller leaves idle (PEER_NICE, PEER_JOBS: the build's niceness, 19, and jobs, 12). PEER_TINY=1 writes gen_gguf.py's tiny model instead (a smoke test of the pipeline;
# llama-bench's figures then mean nothing).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$HERE/llama.cpp
WORK=${PEER_WORK:-/tmp/lily-peer}
BUILD=$WORK/build
MODEL=$WORK/model.gguf
COMMIT=e21cdc11a
BUILD_NUMBER=8783           # `git rev-list --count e21cdc11a`: the export carries no .git
BENCH_ARGS="-ngl 99 -fa 1 -p 512,4096 -n 128 -d 0,4096 -r 3"
BENCH_RESERVE=100           # seconds kept for llama-bench itself: model load (~20 s) and the 18 timed tests + warm-ups
now() { date +%s; }

# `start` takes PEER_DEADLINE or gives itself 540 s and records it; `bench` takes PEER_DEADLINE or that record.
start_deadline() { echo "${PEER_DEADLINE:-$(( $(now) + 540 ))}"; }
bench_deadline() { echo "${PEER_DEADLINE:-$(cat "$WORK/deadline")}"; }

# Runs "$@" in its own session (so it outlives a caller that returns), records its pid and, when it ends,
# its exit status in $WORK/$name.rc.
launch() {
    local name=$1; shift
    rm -f "$WORK/$name.rc" "$WORK/$name.pid"
    local detach=; command -v setsid > /dev/null && detach=setsid
    $detach bash -c 'echo $$ > "$0.pid"; "$@"; echo $? > "$0.rc"' "$WORK/$name" "$@" > "$WORK/$name.log" 2>&1 < /dev/null &
}

build_llama_bench() {
    local left=$(( $1 - BENCH_RESERVE - $(now) ))
    [ $left -gt 0 ] || { echo "no time left to build"; return 124; }
    if [ ! -f "$BUILD/build.ninja" ]; then
        timeout $left cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
            -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a-real -DGGML_CUDA_NCCL=OFF -DGGML_NATIVE=ON \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF \
            -DLLAMA_BUILD_COMMIT=$COMMIT -DLLAMA_BUILD_NUMBER=$BUILD_NUMBER || return $?
    fi
    left=$(( $1 - BENCH_RESERVE - $(now) ))
    [ $left -gt 0 ] || { echo "no time left to build"; return 124; }
    timeout $left nice -n "${PEER_NICE:-19}" cmake --build "$BUILD" --target llama-bench -j "${PEER_JOBS:-12}"
}

generate_model() {
    local left=$(( $1 - BENCH_RESERVE - $(now) ))
    [ $left -gt 0 ] || { echo "no time left to write the model"; return 124; }
    PYTHONPATH=$SRC/gguf-py timeout $left nice -n 19 python3 "$HERE/gen_gguf.py" --out "$MODEL" ${PEER_TINY:+--tiny}
}

env_facts() {
    date -u
    hostname; nproc; free -g | head -2; df -h "$WORK" | tail -1
    nvidia-smi --query-gpu=name,driver_version,memory.total,pstate,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.limit,temperature.gpu --format=csv
    nvcc --version | tail -2
    cmake --version | head -1
}

start() {
    mkdir -p "$WORK"
    local dl; dl=$(start_deadline); echo "$dl" > "$WORK/deadline"
    env_facts > "$WORK/env.txt" 2>&1
    if [ -x "$BUILD/bin/llama-bench" ] && [ "$(cat "$WORK/build.rc" 2>/dev/null)" = 0 ]; then
        echo "peer: llama-bench already built"
    else
        export -f build_llama_bench now; export SRC BUILD COMMIT BUILD_NUMBER BENCH_RESERVE
        launch build build_llama_bench "$dl"
    fi
    if [ "$(cat "$WORK/gen.rc" 2>/dev/null)" = 0 ] && [ -f "$MODEL" ]; then
        echo "peer: model already written"
    else
        export -f generate_model now; export SRC HERE MODEL BENCH_RESERVE PEER_TINY
        launch gen generate_model "$dl"
    fi
    echo "peer: started at $(date -u +%T), deadline $(date -u -d @"$dl" +%T) UTC; work in $WORK"
}

# Ends a background job that is still running when its deadline has passed (its own session, by its pid).
stop_job() {
    local pid; pid=$(cat "$WORK/$1.pid" 2>/dev/null) || return 0
    [ -f "$WORK/$1.rc" ] && return 0
    { kill -- -"$pid" || kill "$pid"; } 2>/dev/null && echo "peer: stopped $1 (pid $pid) at the deadline"
}

bench() {
    local out=${OUT:?OUT must name the folder for the results}
    [ -f "$WORK/deadline" ] || { echo "peer: 'peer.sh start' was not run on this machine"; return 1; }
    local dl; dl=$(bench_deadline)
    local t0; t0=$(now)
    while { [ ! -f "$WORK/build.rc" ] || [ ! -f "$WORK/gen.rc" ]; } && [ $(now) -lt $(( dl - 15 )) ]; do sleep 2; done
    stop_job build; stop_job gen
    local waited=$(( $(now) - t0 ))
    local build_rc gen_rc bench_rc=skipped
    build_rc=$(cat "$WORK/build.rc" 2>/dev/null || echo "unfinished")
    gen_rc=$(cat "$WORK/gen.rc" 2>/dev/null || echo "unfinished")
    local cmd="llama-bench -m model.gguf $BENCH_ARGS -o json -oe md"
    local md_err=$WORK/bench_md.txt
    : > "$md_err"
    if [ "$build_rc" = 0 ] && [ "$gen_rc" = 0 ]; then
        local left=$(( dl - $(now) - 5 ))
        if [ $left -gt 20 ]; then
            # shellcheck disable=SC2086
            timeout $left "$BUILD/bin/llama-bench" -m "$MODEL" $BENCH_ARGS -o json -oe md \
                > "$out/llama_bench.json" 2> "$md_err"
            bench_rc=$?
            # A run cut short leaves the JSON array open; close it so the finished tests still parse.
            if [ $bench_rc -ne 0 ] && [ -s "$out/llama_bench.json" ] && \
               ! tail -c 3 "$out/llama_bench.json" | grep -q ']'; then
                printf '\n]\n' >> "$out/llama_bench.json"
            fi
        else
            bench_rc="no time left (${left}s)"
        fi
    fi
    {
        echo "# llama.cpp peer (issue 14)"
        echo
        echo "- llama.cpp $COMMIT (b$BUILD_NUMBER), CUDA sm_90a, random-weight qwen35moe GGUF, Q4_K_M mix"
        echo "- command: \`$cmd\`"
        echo "- finished $(date -u +'%F %T') UTC; waited ${waited}s for build (rc $build_rc) and model (rc $gen_rc); llama-bench rc $bench_rc"
        echo "- model: $(tail -1 "$WORK/gen.log" 2>/dev/null)"
        echo
        cat "$md_err"
        echo
        echo '## environment'
        echo '```'
        cat "$WORK/env.txt"
        echo "after the bench:"
        nvidia-smi --query-gpu=name,pstate,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.draw,temperature.gpu --format=csv 2>&1
        echo '```'
        echo
        echo '## logs: the model, then the end of the build (cmake configure and ninja)'
        echo '```'
        cat "$WORK/gen.log" 2>/dev/null
        tail -60 "$WORK/build.log" 2>/dev/null
        echo '```'
    } > "$out/llama_bench.md"
    sed -n '1,/^## logs/p' "$out/llama_bench.md"
    [ "$bench_rc" = 0 ]
}

case "${1:-}" in
    start) start ;;
    bench) bench ;;
    *) echo "usage: peer.sh start|bench (PEER_DEADLINE=<epoch s>, PEER_WORK=<dir>, OUT for bench)"; exit 2 ;;
esac
