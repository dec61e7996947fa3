#!/usr/bin/env bash
# `tts verify-golden --dtype float16` and `--dtype bfloat16` on a GPU, at the real 1.7B shapes (random weights):
#   1. build a random checkpoint with the official classes (tools/make_golden.py --build 1.7b-real;
#      the tokenizer is trained on the bundled Harvard sentences, the file make_golden uses by default);
#   2. record golden records of it with the official implementation on the GPU, in fp32 with TF32
#      off (`tts verify-golden --record --device cuda`): 2 prompts x 16 frames, the unforced run
#      capped at 16 frames too. Should that fail, on CPU (measured on a 2-core VM: ~35 s of loading,
#      weight checks and codec plus ~0.55 s per generated frame on the recorder's one thread, ~80
#      frames here: ~1.5 min; the default record, ~560 frames, would take ~6 min);
#   3. check our engine's numerics against them: fp16 weights (the engine's default), then bf16
#      weights, fp32 activations, the fused kernels, the codec in fp32 with TF32 and its vocoder's
#      convolutions with fp16 inputs (`tts verify-golden --device cuda --dtype float16|bfloat16`).
#
# Usage, from the repository root, with the repository, kernels/ and qwen-tts-hf (module qwen_tts)
# importable:
#
#     bash tools/verify_golden_gpu.sh OUT_DIR
#
# Writes OUT_DIR/build.log, OUT_DIR/record.log (and record-cpu.log after a failed GPU recording),
# OUT_DIR/verify-fp16.log and verify-bf16.log (the tables) and OUT_DIR/records/ (records.json + records.safetensors,
# ~3 MB). The checkpoint (~4 GB) goes to a temporary folder that is removed at the end
# (TTS_GOLDEN_CKPT=DIR: build into DIR and keep it; an existing DIR/config.json skips the build).
# TTS_GOLDEN_KIND=base|voice_design builds that kind instead of custom_voice (its records: cloned
# voices, ICL and x-vector, or designed ones). Exit status: that of the failing step, else of the
# checks (0 every check passed, 1 some check failed). Budget: a few minutes on one H200.
set -euo pipefail

out=${1:?usage: bash tools/verify_golden_gpu.sh OUT_DIR}
python=${PYTHON:-python3}
frames=${TTS_GOLDEN_FRAMES:-16}
prompts=${TTS_GOLDEN_PROMPTS:-2}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
mkdir -p "$out"

if [[ -n ${TTS_GOLDEN_CKPT:-} ]]; then
    ckpt=$TTS_GOLDEN_CKPT
else
    ckpt=$(mktemp -d "${TMPDIR:-/tmp}/tts-1.7b-real.XXXXXX")
    trap 'rm -rf "$ckpt"' EXIT
fi

step() {   # step NAME LOG COMMAND...: runs COMMAND, output to the terminal and LOG; returns its status
    local name=$1 log=$2 start=$SECONDS status=0
    shift 2
    echo "== $name: $*" | tee "$log"
    "$@" 2>&1 | tee -a "$log" || status=$?
    echo "== $name: exit status $status, $((SECONDS - start)) s" | tee -a "$log"
    return "$status"
}

if [[ ! -f $ckpt/config.json ]]; then
    step build "$out/build.log" "$python" tools/make_golden.py --build 1.7b-real --ckpt "$ckpt" \
        --kind "${TTS_GOLDEN_KIND:-custom_voice}" --corpus tts_cli/assets/harvard-sentences.txt
fi
record=("$python" -m tts_cli verify-golden --record --model "$ckpt" --out "$out/records" --frames "$frames"
        --prompts "$prompts")
if ! step record "$out/record.log" "${record[@]}" --device cuda; then
    # The official code on CUDA is untested here: then record on CPU (one thread, ~1.5 min at 2 x 16).
    step record-cpu "$out/record-cpu.log" "${record[@]}" --device cpu
fi
status=0
for precision in fp16:float16 bf16:bfloat16; do   # the engine's --talker-precision settings (fp16: the default)
    COLUMNS=200 step verify "$out/verify-${precision%%:*}.log" "$python" -m tts_cli verify-golden \
        --model "$ckpt" --golden "$out/records" --device cuda --dtype "${precision#*:}" || status=$?
done
exit "$status"
