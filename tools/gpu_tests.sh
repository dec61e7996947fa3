#!/usr/bin/env bash
# tests/test_gpu.py on a GPU in halves. The whole file takes ~370 s on the H200, and a device command
# gets at most 600 s, so it runs as two commands:
#
#     bash tools/gpu_tests.sh OUT_DIR 1      # the first half of the collected tests
#     bash tools/gpu_tests.sh OUT_DIR 2      # the rest
#
# Needs the repository and kernels/ importable. Writes OUT_DIR/test-gpu-PART.log (pytest's -q
# output) and prints its last lines. Exit status: pytest's (124 when a half ran past
# TTS_GPU_TESTS_TIMEOUT, default 560 s).
set -uo pipefail

out=${1:?usage: bash tools/gpu_tests.sh OUT_DIR 1|2}
part=${2:?usage: bash tools/gpu_tests.sh OUT_DIR 1|2}
python=${PYTHON:-python3}
mkdir -p "$out"
mapfile -t ids < <("$python" -m pytest -q --collect-only tests/test_gpu.py 2>/dev/null | grep '::')
if (( ${#ids[@]} == 0 )); then
    echo "no tests collected from tests/test_gpu.py" >&2
    exit 2
fi
half=$(( (${#ids[@]} + 1) / 2 ))
case $part in
    1) chosen=("${ids[@]:0:half}") ;;
    2) chosen=("${ids[@]:half}") ;;
    *) echo "PART must be 1 or 2, not $part" >&2; exit 2 ;;
esac
echo "part $part: ${#chosen[@]} of ${#ids[@]} tests" >"$out/test-gpu-$part.log"
timeout "${TTS_GPU_TESTS_TIMEOUT:-560}" "$python" -m pytest -q "${chosen[@]}" >>"$out/test-gpu-$part.log" 2>&1
status=$?
tail -5 "$out/test-gpu-$part.log"
exit $status
