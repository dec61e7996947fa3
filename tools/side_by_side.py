#!/usr/bin/env python
"""The official implementation (PyPI `qwen-tts-hf`) and `tts` side by side, in one run, on the
same checkpoint and the same work: the first B bundled Harvard sentences, speaker Vivian, English,
every request forced to F frames (random weights never end speech). Wall time includes the codec
decode to waveforms on both sides; each side is warmed up once per batch size before it is timed.

Needs the reference environment (qwen-tts-hf installed --no-deps, as `make test` does) with this
repository importable. On the GPU machine, with random weights at the real 1.7B shapes built by the
official classes:

    python tools/side_by_side.py --build 1.7b-real --ckpt /tmp/real --batches 1,64 --frames 100 \\
        --device cuda --dtype bfloat16 --json side_by_side.json

`tts` runs its engine there (CUDA graphs, kernels; the codec in fp32 with TF32 as `tts synth` runs it); on
CPU both run their plain paths. Not a quality comparison: the audio of random weights is noise.
The built checkpoint has every real shape except the text embedding table, which has the rows of
make_golden's small tokenizer (1088, not 151936): one lookup per token, no effect on decode speed.
Checked on CPU at those shapes (batch 1, 2 frames): both implementations load and run it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))

from tts_cli.quality.reference import forced_length, import_official  # noqa: E402
from tts_cli.request import Request  # noqa: E402
from tts_cli.synthesizer import Synthesizer, allow_tf32  # noqa: E402

SENTENCES = ROOT / "tts_cli" / "assets" / "harvard-sentences.txt"
SAMPLE_RATE = 24000


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(device: str, fn):
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - start


def run_official(ckpt: Path, texts: list[str], frames: int, device: str, dtype: torch.dtype) -> tuple[float, float]:
    """(audio seconds, wall seconds) of one generate_custom_voice call over all texts."""
    qwen_tts = import_official()
    tts = qwen_tts.Qwen3TTSModel.from_pretrained(str(ckpt), device_map=device, dtype=dtype,
                                                 attn_implementation="sdpa" if device.startswith("cuda") else "eager")
    call = dict(speaker=["Vivian"] * len(texts), language=["English"] * len(texts))
    with forced_length():   # max_new_tokens = F + 1 gives exactly F frames
        tts.generate_custom_voice(texts, max_new_tokens=2, **call)
        (wavs, rate), wall = _timed(device, lambda: tts.generate_custom_voice(texts, max_new_tokens=frames + 1, **call))
    audio = sum(len(w) for w in wavs) / rate
    if any(len(w) != frames * 1920 for w in wavs):
        raise AssertionError(f"official: lengths {[len(w) for w in wavs]}, expected {frames * 1920} each")
    return audio, wall


def run_tts(ckpt: Path, texts: list[str], frames: int, device: str, dtype: torch.dtype) -> tuple[float, float]:
    if device.startswith("cuda"):
        allow_tf32()   # as `tts synth` runs the codec there (after the official side: it runs in bf16)
    synth = Synthesizer.from_pretrained(ckpt, device=device, dtype=dtype)
    requests = [Request(id=str(i), text=t, speaker="vivian", language="english", seed=i) for i, t in enumerate(texts)]
    synth.synthesize(requests, max_frames=2, min_new_tokens=3)
    results, wall = _timed(device, lambda: synth.synthesize(requests, max_frames=frames, min_new_tokens=frames + 1))
    if any(len(r.audio) != frames * 1920 for r in results):
        raise AssertionError(f"tts: lengths {[len(r.audio) for r in results]}, expected {frames * 1920} each")
    return sum(len(r.audio) for r in results) / SAMPLE_RATE, wall


def side_by_side(ckpt: Path, batches: list[int], frames: int, device: str, dtype: torch.dtype) -> list[dict]:
    sentences = [s for s in SENTENCES.read_text(encoding="utf-8").splitlines() if s.strip()]
    rows = []
    for batch in batches:
        texts = sentences[:batch]
        row = {"batch": batch, "frames": frames}
        for name, run in (("official", run_official), ("tts", run_tts)):
            audio, wall = run(ckpt, texts, frames, device, dtype)
            row[name] = {"audio_s": round(audio, 3), "wall_s": round(wall, 4), "audio_s_per_s": round(audio / wall, 3)}
        row["ratio"] = round(row["tts"]["audio_s_per_s"] / row["official"]["audio_s_per_s"], 2)
        print(f"batch {batch}: official {row['official']['audio_s_per_s']} audio-s/s, "
              f"tts {row['tts']['audio_s_per_s']} audio-s/s, ratio {row['ratio']}x", flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", type=Path, required=True, help="checkpoint folder (official layout)")
    ap.add_argument("--build", metavar="VARIANT", help="first write a random checkpoint of this "
                    "tools/make_golden.py variant (e.g. 1.7b-real) into --ckpt, with the official classes")
    ap.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--frames", type=int, default=100)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", type=Path, help="where to write the results")
    a = ap.parse_args(argv)
    if a.build:
        sys.path.insert(0, str(ROOT / "tools"))
        import make_golden
        make_golden.build_checkpoint(a.ckpt, a.build)
    rows = side_by_side(a.ckpt, [int(b) for b in a.batches.split(",")], a.frames, a.device, getattr(torch, a.dtype))
    result = {"checkpoint": str(a.ckpt), "device": a.device, "dtype": a.dtype, "forced_length": True,
              "gpu": torch.cuda.get_device_name() if a.device.startswith("cuda") else None,
              "torch": torch.__version__, "rows": rows}
    if a.json:
        a.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
