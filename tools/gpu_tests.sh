#!/usr/bin/env bash
# tests/test_gpu.py on a GPU in parts. Its 102 tests took 507 s on the H200 at 296d7f7 (128, 201, 178 s; the kernels
# compiled by an earlier command; at 2d8ea8e, 105 tests, parts 1 and 2 at once: 304 and 238 s, then 196), and a device
# command gets at most 600 s, so it runs as several commands:
#
#     bash tools/gpu_tests.sh OUT_DIR 1 3    # the first third of the collected tests
#     bash tools/gpu_tests.sh OUT_DIR 2 3    # ... PARTS defaults to 3
#
# Needs the repository and kernels/ importable. Writes OUT_DIR/test-gpu-PART.log (pytest's -q
# output) and prints its last lines. Exit status: pytest's (124 when a part ran past
# TTS_GPU_TESTS_TIMEOUT, default 560 s).
set -uo pipefail

usage="usage: bash tools/gpu_tests.sh OUT_DIR PART [PARTS]"
out=${1:?$usage}
part=${2:?$usage}
parts=${3:-3}
python=${PYTHON:-python3}
mkdir -p "$out"
mapfile -t ids < <("$python" -m pytest -q --collect-only tests/test_gpu.py 2>/dev/null | grep '::')
if (( ${#ids[@]} == 0 )); then
    echo "no tests collected from tests/test_gpu.py" >&2
    exit 2
fi
if ! [[ $parts =~ ^[1-9][0-9]*$ && $part =~ ^[1-9][0-9]*$ ]] || (( part > parts )); then
    echo "PART must be 1..PARTS, not $part of $parts" >&2
    exit 2
fi
size=$(( (${#ids[@]} + parts - 1) / parts ))
chosen=("${ids[@]:$(( (part - 1) * size )):size}")
echo "part $part: ${#chosen[@]} of ${#ids[@]} tests" >"$out/test-gpu-$part.log"
timeout "${TTS_GPU_TESTS_TIMEOUT:-560}" "$python" -m pytest -q "${chosen[@]}" >>"$out/test-gpu-$part.log" 2>&1
status=$?
tail -5 "$out/test-gpu-$part.log"
exit $status
