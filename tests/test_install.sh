#!/usr/bin/env bash
# Uses nanoddp the two ways another project would, and runs that project on two ranks:
#   1. installed: `meson install` of this build into a temporary staging folder; the project
#      (examples/own_project) finds it through the staged nanoddp.pc (PKG_CONFIG_SYSROOT_DIR
#      maps the install prefix into the staging folder, as a packager's staging build does);
#   2. as a Meson subproject: subprojects/nanoddp links to this source tree.
# Before that it checks the installed headers: every public header of core/ kernels/ nn/
# data/ dist/ is there, and a file including all of them as <nanoddp/...> compiles with only
# `pkg-config --cflags nanoddp` (so their own includes resolve from the prefix).
# The installed programs run without LD_LIBRARY_PATH, and the subproject leaves CUDA out when no
# GPU answers. Both builds must train to the same loss, below a tenth of the first, with
# identical replicas. Usage: test_install.sh SOURCE_ROOT BUILD_ROOT
set -euo pipefail
src=$(realpath "$1")
build=$(realpath "$2")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# Headers that stay internal: included only by the library's own .cpp files.
private_headers=(core/file_io.h core/half_convert.h core/replace_file.h dist/detail.h dist/gloo_store.h dist/nccl_protocol.h dist/ring_shm.h
                 nn/conv_groups.h dist/host_fingerprints.h dist/start_worker.h dist/deadline.h kernels/grad_norm_term.h
                 dist/launch_detail.h dist/output_relay.h dist/shm_progress.h dist/shm_segment.h dist/shm_wait.h dist/store_client.h
                 dist/store_server.h dist/store_wire.h)

echo "== meson install into a staging folder"
meson install -C "$build" --no-rebuild --destdir "$work/stage" >"$work/install.log" ||
  { cat "$work/install.log"; fail "meson install failed"; }
pc=$(find "$work/stage" -name nanoddp.pc)
[[ -n "$pc" ]] || fail "no nanoddp.pc installed"
export PKG_CONFIG_PATH=$(dirname "$pc") PKG_CONFIG_SYSROOT_DIR="$work/stage"
includedir="$work/stage$(PKG_CONFIG_SYSROOT_DIR= pkg-config --variable=includedir nanoddp)"
libdir="$work/stage$(PKG_CONFIG_SYSROOT_DIR= pkg-config --variable=libdir nanoddp)"
launcher=$(find "$work/stage" -name nanoddp-run -type f)
[[ -f "$libdir/libnanoddp.so" ]] || fail "libnanoddp.so is not in $libdir"
[[ -x "$launcher" ]] || fail "nanoddp-run is not installed"
[[ -f "$includedir/nanoddp/nanoddp.h" ]] || fail "nanoddp/nanoddp.h is not installed"

echo "== every public header is installed and compiles from the prefix"
umbrella="$work/all_headers.cpp"
echo '#include <nanoddp/nanoddp.h>' >"$umbrella"
for header in "$src"/{core,kernels,nn,data,dist}/*.h; do
  relative=${header#"$src"/}
  [[ " ${private_headers[*]} " == *" $relative "* ]] && continue
  [[ -f "$includedir/nanoddp/$relative" ]] ||
    fail "$relative is not installed: add it to install_headers in $(dirname "$relative")/meson.build (or to private_headers here)"
  echo "#include <nanoddp/$relative>" >>"$umbrella"
done
echo 'int main() { return 0; }' >>"$umbrella"
# What a program calls comes with the umbrella: a public header it leaves out is named here.
beside_umbrella=(core/file_size_limit.h core/hash.h core/storage.h dist/launcher_link.h)
for header in "$src"/{core,nn,data,dist}/*.h; do
  relative=${header#"$src"/}
  [[ " ${private_headers[*]} ${beside_umbrella[*]} " == *" $relative "* ]] && continue
  grep -q "#include \"$relative\"" "$src/include/nanoddp/nanoddp.h" ||
    fail "$relative is public but nanoddp/nanoddp.h does not include it (include it, or list it in beside_umbrella)"
done
# shellcheck disable=SC2046
c++ -std=c++17 -fsyntax-only $(pkg-config --cflags nanoddp) "$umbrella" || fail "the installed headers do not compile"

# Runs the project's program on two ranks with the given launcher; prints rank 0's JSON line.
run_two_ranks() {
  local launcher=$1 program=$2
  timeout 300 "$launcher" --nproc-per-node 2 "$program" >"$work/run.log" 2>&1 ||
    { cat "$work/run.log" >&2; fail "$program failed on two ranks"; }
  grep -o '{"world_size".*}' "$work/run.log" || { cat "$work/run.log" >&2; fail "no result line from $program"; }
}

echo "== own_project against the installed nanoddp (pkg-config)"
cp -r "$src/examples/own_project" "$work/installed"
meson setup "$work/installed/build" "$work/installed" --wrap-mode=nofallback >"$work/setup.log" ||
  { cat "$work/setup.log"; fail "meson setup against the installed nanoddp failed"; }
grep -q "Run-time dependency nanoddp found: YES" "$work/setup.log" || fail "nanoddp not found through pkg-config"
ninja -C "$work/installed/build" -j2 >/dev/null || fail "own_project did not build against the installed nanoddp"
# Neither the installed nanoddp-run nor the program gets LD_LIBRARY_PATH: their run paths find
# libnanoddp.so (nanoddp-run's relative to its folder, the program's from nanoddp.pc's libdir,
# here mapped into the staging folder as the -L path is).
unset LD_LIBRARY_PATH
for program in "$launcher" "$work/installed/build/swish_regression"; do
  loaded=$(ldd "$program" | awk '$1 == "libnanoddp.so" { print $3 }')
  [[ "$loaded" == /* ]] ||
    fail "$program cannot find libnanoddp.so without LD_LIBRARY_PATH: $(ldd "$program" | grep libnanoddp)"
  [[ "$(realpath "$loaded")" == "$(realpath "$libdir/libnanoddp.so")" ]] ||
    fail "$program loads $loaded, not the installed $libdir/libnanoddp.so"
done
"$launcher" --help >/dev/null || fail "the installed nanoddp-run does not start"
installed_result=$(run_two_ranks "$launcher" "$work/installed/build/swish_regression")
echo "$installed_result"

echo "== own_project with nanoddp as a subproject"
unset PKG_CONFIG_PATH PKG_CONFIG_SYSROOT_DIR
cp -r "$src/examples/own_project" "$work/subproject"
mkdir "$work/subproject/subprojects"
ln -s "$src" "$work/subproject/subprojects/nanoddp"
# Without Gloo and MPI: the job runs on shm either way, and the subproject compiles the whole
# library a second time, the longest part of this test. CUDA is left to the subproject's own
# decision: built only when a GPU answers, as tools/build decides.
# --buildtype=plain (no -O): this part checks the wiring (options, CUDA's decision, linking,
# a run), and the library's compile at -O0 takes half the time it does at -O3.
# --unity=subprojects: the library's files compiled a few to a translation unit, which at -O0
# halves the time again (60 s against 106 s); the default build compiles them one by one.
meson setup "$work/subproject/build" "$work/subproject" --force-fallback-for=nanoddp --buildtype=plain --unity=subprojects \
  -Dnanoddp:gloo=disabled -Dnanoddp:mpi=disabled \
  >"$work/setup.log" || { cat "$work/setup.log"; fail "meson setup with nanoddp as a subproject failed"; }
if nvidia-smi -L >/dev/null 2>&1; then expected_cuda="a GPU answered"; else expected_cuda="no GPU answered"; fi
grep -q "cuda decided by *: *$expected_cuda nvidia-smi -L" "$work/setup.log" ||
  { cat "$work/setup.log"; fail "the subproject did not decide CUDA by the GPU (expected: $expected_cuda)"; }
if [[ $expected_cuda == "no GPU answered" ]]; then
  grep -Eq "^ *cuda *: *(NO|False)$" "$work/setup.log" || { cat "$work/setup.log"; fail "the subproject built CUDA without a GPU"; }
fi
ninja -C "$work/subproject/build" -j2 swish_regression subprojects/nanoddp/tools/nanoddp-run >/dev/null ||
  fail "own_project did not build with nanoddp as a subproject"
subproject_result=$(run_two_ranks "$work/subproject/build/subprojects/nanoddp/tools/nanoddp-run" \
  "$work/subproject/build/swish_regression")
echo "$subproject_result"

echo "== results"
python3 - "$installed_result" "$subproject_result" <<'PY'
import json, sys
installed, subproject = (json.loads(s) for s in sys.argv[1:])
assert installed["world_size"] == 2, installed
assert installed["replica_difference"] == 0, installed
assert installed["gradient_error"] < 1e-4, installed
assert installed["last_loss"] < installed["first_loss"] / 10, installed
assert installed == subproject, (installed, subproject)
print("installed and subproject builds train identically:", installed)
PY
