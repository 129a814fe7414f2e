#!/usr/bin/env bash
# -Dgpu_lib_dirs and -Dnccl_dirs reach the linker: a CUDA configure with DIR holding its own
# libcudart.so, libcublas.so and libnccl.so (tiny stand-ins made here) must link the library
# against DIR's files by absolute path, DIR ahead of the toolkit's own copies. tools/gpu-check
# relies on it where a toolkit has only versioned names (libcublas.so.13). Only configures: no
# compile. Exits 77 (Meson's SKIP) without nvcc. Usage: test_gpu_lib_dirs.sh SOURCE_ROOT
set -euo pipefail
src=$(realpath "$1")
if ! command -v nvcc >/dev/null; then
  [[ -x /usr/local/cuda/bin/nvcc ]] || { echo "SKIP: no nvcc (a CUDA toolkit) to configure with"; exit 77; }
  export PATH="/usr/local/cuda/bin:$PATH"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

mkdir -p "$work/gpu" "$work/nccl"
echo 'int nanoddp_stand_in() { return 0; }' >"$work/stand_in.cpp"
for lib in gpu/libcudart gpu/libcublas nccl/libnccl; do
  c++ -shared -fPIC -o "$work/$lib.so" "$work/stand_in.cpp" || fail "cannot build the stand-in $lib.so"
done
meson setup "$work/build" "$src" -Dcuda=enabled -Dtests=false -Dexamples=false -Dgloo=disabled -Dmpi=disabled \
  "-Dgpu_lib_dirs=$work/gpu" "-Dnccl_dirs=$work/nccl" >"$work/setup.log" 2>&1 ||
  { cat "$work/setup.log"; fail "meson setup failed"; }
ninja_file="$work/build/build.ninja"
for lib in gpu/libcudart gpu/libcublas nccl/libnccl; do
  grep -q -- "$work/$lib.so" "$ninja_file" || fail "$work/$lib.so is on no link line of build.ninja"
  echo "ok: $lib.so is linked by its absolute path"
done
# The bare -l form would find the toolkit's copies instead.
if grep -qE -- '(^| )-l(cudart|cublas)( |$)' "$ninja_file"; then
  fail "build.ninja still links a bare -lcudart or -lcublas"
fi
echo "ok: no bare -lcudart or -lcublas"
