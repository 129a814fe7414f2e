#!/usr/bin/env bash
# tools/gpu-check's report of carried libraries that do not load (its environment block shows
# it): a library whose dependency is missing is named with that dependency, a library that
# needs a symbol version this host's C library lacks is named with the version, and a library
# that loads is "ok". Usage: test_gpu_check_libs.sh SOURCE_ROOT
set -euo pipefail
src=$(realpath "$1")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

mkdir -p "$work/lib" "$work/gone"
echo 'int gone_value() { return 1; }' >"$work/gone.cpp"
echo 'int gone_value(); int needs_gone() { return gone_value(); }' >"$work/needs.cpp"
echo 'int loads() { return 2; }' >"$work/loads.cpp"
c++ -shared -fPIC -o "$work/gone/libgone.so" "$work/gone.cpp"
c++ -shared -fPIC -o "$work/lib/libneeds_gone.so.1" "$work/needs.cpp" -L"$work/gone" -lgone
c++ -shared -fPIC -o "$work/lib/libloads.so.1" "$work/loads.cpp"
# A symbol version its dependency lacks, as a library built against a newer glibc than this
# host's asks for one: libnewer needs value@NEWER_2 of libbase, and the libbase here is older.
echo 'int value() { return 3; }' >"$work/base.cpp"
echo 'NEWER_2 { global: *; };' >"$work/base.map"
echo 'int value(); int newer() { return value(); }' >"$work/newer.cpp"
c++ -shared -fPIC -o "$work/lib/libbase.so" "$work/base.cpp" -Wl,--version-script="$work/base.map"
c++ -shared -fPIC -o "$work/lib/libnewer.so.1" "$work/newer.cpp" -L"$work/lib" -lbase
echo 'OLDER_1 { global: *; };' >"$work/older.map"  # the older libbase, without NEWER_2
c++ -shared -fPIC -o "$work/lib/libbase.so" "$work/base.cpp" -Wl,--version-script="$work/older.map"
export LD_LIBRARY_PATH="$work/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

status=0
report=$("$src/tools/gpu-check" carried-libs "$work/lib") || status=$?
echo "$report"
[[ $status -eq 1 ]] || fail "exit status $status with libraries that do not load, expected 1"
grep -q '^carried lib: libneeds_gone.so.1 FAILS to load: .*libgone.so => not found' <<<"$report" ||
  fail "the missing dependency of libneeds_gone.so.1 is not named"
grep -q '^carried lib: libloads.so.1 ok$' <<<"$report" || fail "libloads.so.1 is not reported as loading"
grep -q "^carried lib: libnewer.so.1 FAILS to load: .*NEWER_2.* not found" <<<"$report" ||
  fail "the symbol version libnewer.so.1 misses is not named"
grep -q '^carried lib: libbase.so ok$' <<<"$report" || fail "libbase.so is not reported as loading"

rm "$work/lib/libneeds_gone.so.1" "$work/lib/libnewer.so.1"
"$src/tools/gpu-check" carried-libs "$work/lib" >/dev/null || fail "exit status non-zero when every library loads"
echo "ok"
