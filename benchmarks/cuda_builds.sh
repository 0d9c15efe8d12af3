# How the CUDA pieces a device call runs are built: lily._core with the CUDA backend and the standalone CUDA
# harnesses, on the device (cuda_device.sh, cuda_ab.sh) or here ahead of it (cuda_prebuild.sh into .prebuilt/,
# carried). Sourced from the tree's root.

# build_core PYTHON DIR JOBS: lily._core for PYTHON in DIR (cmake, Ninja), its output on stdout
build_core() {
  cmake -S . -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$1" -DLILY_METAL_EMU=OFF &&
    cmake --build "$2" -j"$3"
}

# build_harness NAME OUTPUT [NVCC FLAGS]: benchmarks/cuda/NAME_kernels.cu (decode, prefill) for sm_90a
build_harness() {
  local name=$1 out=$2
  shift 2
  nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 -I csrc "$@" "benchmarks/cuda/${name}_kernels.cu" -o "$out"
}

# One hash of every file the prebuilt items are built from (csrc/, the metal/ sources lily._core embeds and the
# headers they share with the host, cmake/, the build files, the CUDA harnesses): the same here and on the device
# for the same tree.
prebuilt_hash() {
  find csrc metal cmake benchmarks/cuda CMakeLists.txt pyproject.toml -type f -print0 | LC_ALL=C sort -z |
    xargs -0 sha256sum | sha256sum | cut -c1-16
}

# prebuilt NAME: .prebuilt/NAME.gz unpacked to build/NAME, where .prebuilt was built from this tree; fails (the
# caller then builds) where it was not, or where NAME is not in it.
prebuilt() {
  [ -f .prebuilt/sources ] && [ -f ".prebuilt/$1.gz" ] && [ "$(cat .prebuilt/sources)" = "$(prebuilt_hash)" ] &&
    mkdir -p build && gunzip -c ".prebuilt/$1.gz" >"build/$1" && chmod +x "build/$1" &&
    echo "== prebuilt $1 ($(cat .prebuilt/sources))"
}
