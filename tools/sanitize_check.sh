#!/usr/bin/env bash
# Builds the CPU library again with AddressSanitizer + UndefinedBehaviorSanitizer (into
# build/sanitize, see tools/sanitize_build.py) and runs the native-op tests against it, once per
# CPU kernel copy this machine can run. Any sanitizer report fails the check.
#
#   bash tools/sanitize_check.sh [OUT_DIR]      (default build/sanitize; run inside the venv)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="$(realpath -m "${1:-build/sanitize}")"
mkdir -p "$OUT"

# The build tools pip's isolated build environment had for the packaged library.
python -c "import setuptools, ninja" 2>/dev/null || pip install -q setuptools ninja

echo "-- building the sanitized library (log: $OUT/build.log)"
if ! python tools/sanitize_build.py "$OUT" >"$OUT/build.log" 2>&1; then
    tail -n 60 "$OUT/build.log"
    exit 1
fi
LIBRARY="$(tail -n 1 "$OUT/build.log")"

# Python is not instrumented, so the ASan runtime must be the first library loaded (libubsan comes
# in as a dependency of the library). libstdc++ must be loaded when ASan starts too: ASan looks up
# the real __cxa_throw then, and without it every C++ exception aborts in ASan's interceptor.
ASAN_RUNTIME="$(ldd "$LIBRARY" | awk '/libasan/ {print $3}')"
CXX_RUNTIME="$(ldd "$LIBRARY" | awk '/libstdc\+\+/ {print $3}')"
if [[ ! -f "$ASAN_RUNTIME" || ! -f "$CXX_RUNTIME" ]]; then
    echo "libasan or libstdc++ missing among the dependencies of $LIBRARY:"; ldd "$LIBRARY"; exit 1
fi

# Every native-op test on the best copy; on the others, the kernel tests only (the input checks,
# cache bookkeeping and opcheck's schema checks do not depend on the copy) and the parity grid in
# float32 only (the dtypes' load paths run in the other kernel tests), to stay within minutes.
ALL_TESTS=(tests/test_native_ops.py tests/test_native_errors.py tests/test_caches.py)
ALL_TESTS+=(tests/test_quantized.py tests/test_paged_ops.py tests/test_paged_quantized.py)  # the quantized and paged kernels and checks
ALL_TESTS+=(tests/test_kivi.py tests/test_latent_ops.py tests/test_latent_quantized.py)  # the KIVI and latent (MLA) kernels
ALL_TESTS+=(tests/test_value_head_dim.py)  # values of their own head_dim (plain and paged kernels)
ALL_TESTS+=(tests/test_paged_latent_ops.py tests/test_paged_latent_quantized.py)  # the paged latent ones
ALL_TESTS+=(tests/test_small_batch_linear.py tests/test_int8_weight_linear.py tests/test_int4_weight_linear.py)  # the weights' products
[[ -f tests/test_fuzz.py ]] && ALL_TESTS+=(tests/test_fuzz.py)
KERNEL_TESTS=(tests/test_native_ops.py -k "not opcheck and (not test_decode_attention_parity or float32)")

run_sanitized() {
    # detect_leaks=0: CPython and torch keep allocations alive until exit by design. log_path:
    # pytest captures fd 2 into a file it loses when the process aborts, so reports go to files
    # ($SANITIZER_LOG.<pid>, one per process, forked children included).
    LD_PRELOAD="$ASAN_RUNTIME $CXX_RUNTIME" \
    ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:detect_stack_use_after_return=1:log_path=$SANITIZER_LOG" \
    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$SANITIZER_LOG" \
    KVCACHE_EXT_LIBRARY="$LIBRARY" KVCACHE_EXT_REQUIRE_NATIVE=1 PYTHONPATH="$PWD/tools${PYTHONPATH:+:$PYTHONPATH}" \
    "$@"
}

# The copies this CPU runs, best first, as the library itself decides.
SANITIZER_LOG="$OUT/sanitizer-startup"
rm -f "$SANITIZER_LOG".*
runnable="$(run_sanitized python -c '
import torch, kvcache_ext
names = kvcache_ext.CPU_ISAS
print(*[names[i] for i in reversed(range(len(names))) if torch.ops.kvcache_ext.select_cpu_isa(i) == i])')"
read -r -a ISAS <<<"$runnable"
[[ ${#ISAS[@]} -gt 0 ]] || { echo "the sanitized library reports no CPU kernel copy"; exit 1; }
echo "-- CPU kernel copies to test: ${ISAS[*]}"

status=0
for isa in "${ISAS[@]}"; do
    log="$OUT/pytest-$isa.log"
    if [[ $isa == "${ISAS[0]}" ]]; then tests=("${ALL_TESTS[@]}"); else tests=("${KERNEL_TESTS[@]}"); fi
    echo "-- ${tests[*]} on the $isa copy (log: $log)"
    SANITIZER_LOG="$OUT/sanitizer-$isa"
    rm -f "$SANITIZER_LOG".*
    set +e
    KVCACHE_EXT_TEST_ISA="$isa" run_sanitized \
        python -m pytest -p no:cacheprovider -p sanitize_isa_plugin "${tests[@]}" >"$log" 2>&1
    rc=$?
    set -e
    tail -n 3 "$log"
    # Belt and braces: a report in any process (a forked child whose failure a test tolerates, an
    # abort pytest swallows) or printed outside the log files still fails the check.
    reports=("$SANITIZER_LOG".*)
    if [[ -e ${reports[0]} ]] || grep -qE "runtime error:|AddressSanitizer|UndefinedBehaviorSanitizer" "$log"; then
        echo "!! sanitizer report on the $isa copy:"
        cat "$SANITIZER_LOG".* 2>/dev/null | head -n 60 || true
        grep -hE -A 30 "runtime error:|ERROR: AddressSanitizer|UndefinedBehaviorSanitizer" "$log" | head -n 60 || true
        status=1
    fi
    if [[ $rc -ne 0 ]]; then
        echo "!! pytest failed on the $isa copy (exit $rc); last lines of $log:"
        tail -n 40 "$log"
        status=1
    fi
done
exit $status
