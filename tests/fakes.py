"""A fake synthesizer for tests of the pipeline around the model (CLI, job, outputs, ledger)."""
import shutil
from pathlib import Path

import numpy as np
import torch

from tts_cli import cli
from tts_cli.errors import RequestError
from tts_cli.request import Result

SAMPLES_PER_FRAME = 1920


class FakeSynthesizer:
    """The Synthesizer interface with made-up audio: frames = text length mod 5 + 2.

    A text with "boom" is a RequestError; with "oom-always" the batch runs out of CUDA memory
    whatever its size; with "oom-shared" it does so only in a batch of more than one row; with
    "host-oom" host memory runs out (torch's CPU allocator's error) in a batch of more than one row; with
    "[bug]" the call raises a ValueError (not a row's fault); with "[nan]" the row's audio holds a NaN."""
    speakers = ["ryan", "vivian"]
    languages = ["auto", "chinese", "english"]
    supports_instruct = True
    sample_rate = 24000
    numerics = "float32 (the fake's)"

    def __init__(self):
        self.batches = []
        self.max_rows = []   # the engine-slot cap of each call
        self.notes = []      # what the synthesizer chose on its own (Synthesizer.notes)

    def validate(self, request):
        if request.speaker not in self.speakers:
            raise RequestError(f"unknown speaker {request.speaker!r}; valid: {', '.join(self.speakers)}")
        if request.language not in self.languages:
            raise RequestError(f"unknown language {request.language!r}; valid: {', '.join(self.languages)}")

    def synthesize(self, requests, greedy=False, max_frames=None, max_rows=None, on_result=None, cancel=None):
        self.batches.append([r.id for r in requests])
        self.max_rows.append(max_rows)
        if any("oom-always" in r.text for r in requests) or (
                len(requests) > 1 and any("oom-shared" in r.text for r in requests)):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake)")
        if len(requests) > 1 and any("host-oom" in r.text for r in requests):
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                               "memory: you tried to allocate 46725145600 bytes (fake)")
        if any("[bug]" in r.text for r in requests):
            raise ValueError("a bug in synthesis (fake)")
        if len(requests) > 1 and any("boom" in r.text for r in requests):
            raise RequestError("a row of this batch is bad")
        if any("boom" in r.text for r in requests):
            raise RequestError("boom is not speakable")
        results = []
        for r in requests:
            frames = len(r.text) % 5 + 2
            hit_cap = max_frames is not None and frames >= max_frames
            frames = min(frames, max_frames or frames)
            audio = 0.3 * np.sin(np.arange(frames * SAMPLES_PER_FRAME, dtype=np.float32) / 10)
            if "[nan]" in r.text:
                audio[100] = np.nan
            results.append(Result(r.id, torch.zeros(frames, 16, dtype=torch.int64), audio, hit_cap))
        return results


def use_fake_synthesizer(monkeypatch, tmp_path) -> FakeSynthesizer:
    """`tts synth --model tmp_path/model` then runs on a FakeSynthesizer."""
    synth = FakeSynthesizer()
    def load(model_dir, device, engine_rows=None, depth=None, codec_precision=None, talker_precision=None):
        synth.loaded_with = {"device": device, "engine_rows": engine_rows, "depth": depth,
                             "codec_precision": codec_precision, "talker_precision": talker_precision}
        return synth

    monkeypatch.setattr(cli, "load_synthesizer", load)
    monkeypatch.delenv("TTS_MODEL", raising=False)
    checkpoint_with_empty_weights(tmp_path / "model")
    return synth


def checkpoint_with_empty_weights(folder: Path) -> Path:
    """The bundled model's folder with empty files for its weights: all that tts synth checks before it loads a
    model (configs, tokenizer, weights files present), for tests whose loader is replaced; a real load fails."""
    shutil.copytree(cli.BUNDLED_MODEL_DIR, folder, ignore=shutil.ignore_patterns("*.safetensors"), dirs_exist_ok=True)
    for weights in cli.BUNDLED_MODEL_DIR.rglob("*.safetensors"):
        (folder / weights.relative_to(cli.BUNDLED_MODEL_DIR)).touch()
    return folder
