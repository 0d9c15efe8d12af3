# What benchmarks/cuda_prebuild.sh builds here for the device machine (.prebuilt/, carried), and how the device
# takes it. Sourced by cuda_prebuild.sh and cuda_device.sh.

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
