"""`tts bench --workload`: what the benchmark's requests ask for.

  customvoice     a named speaker (CustomVoice model), the non-streaming text mode
  clone-icl       one cloned voice for every request (Base model), ICL: the reference's x-vector,
                  transcript and codes in each prompt, the codec primed with the reference
  clone-xvector   the same voice from its x-vector only

Cloning runs in the official default text mode of voice cloning (streaming text: one trailing text
vector per decode step) — a corpus job in one cloned voice, the case tts is built for.

The reference: `--ref-seconds` of a synthetic voiced signal (harmonics of a gliding pitch at a
syllable-rate loudness), encoded once, before the timed runs, by the encoders of the model (for
random:1.7b / random:0.6b: random_encoders, the released shapes with random weights, so the
encoders' cost is that of the real ones); the encode time is reported beside the runs. Its transcript
is taken from the sentence list, about as long as the reference would speak it.

This module imports no torch when loaded: the CLI reads its choices here.
"""
from __future__ import annotations

import itertools
import math
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from tts_cli.request import VoiceReference

WORKLOADS = ("customvoice", "clone-icl", "clone-xvector")
DEFAULT_WORKLOAD = "customvoice"
ORDERS = ("given", "longest")   # the bench's queue: tts_cli.bench.run_bench
DEFAULT_REF_SECONDS = 5.0
CHARS_PER_SECOND = 14.0   # as tts_cli.bench: the speaking rate that sizes the transcript


def model_kind(workload: str) -> str:
    """The checkpoint kind a workload needs (tts_cli.checkpoint.MODEL_KINDS)."""
    from tts_cli.checkpoint import BASE, CUSTOM_VOICE
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}: one of {', '.join(WORKLOADS)}")
    return CUSTOM_VOICE if workload == "customvoice" else BASE


def synthetic_voice(seconds: float, sample_rate: int = 24000) -> torch.Tensor:
    """[seconds * sample_rate] float32 in [-1, 1]: eight harmonics of a pitch gliding between 100 and
    160 Hz, loudness rising and falling four times a second (syllables), a little noise. The same
    samples every call."""
    import torch
    t = torch.arange(round(seconds * sample_rate), dtype=torch.float64) / sample_rate
    pitch_phase = 2 * math.pi * (130 * t - 30 / (2 * math.pi * 0.7) * torch.cos(2 * math.pi * 0.7 * t))
    voiced = sum(torch.sin(k * pitch_phase) / k for k in range(1, 9))
    syllables = 0.55 + 0.45 * torch.sin(2 * math.pi * 4 * t) ** 2
    noise = torch.randn(t.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    signal = voiced * syllables + 0.02 * noise
    return (0.5 * signal / signal.abs().max()).float()


def transcript(sentences: list[str], seconds: float) -> str:
    """Sentences from the list, in order, up to about what `seconds` of speech says (one at least)."""
    chosen: list[str] = []
    for sentence in itertools.cycle(sentences):
        if chosen and len(" ".join(chosen + [sentence])) > seconds * CHARS_PER_SECOND:
            return " ".join(chosen)
        chosen.append(sentence)
    raise ValueError("no sentences")


def encoders(synth, size: str | None):
    """(speaker encoder, codec encoder) of the synthesizer's model on its device: the random ones of
    that size (random:...), else the checkpoint's."""
    device = synth.model.talker.codec_embedding.weight.device
    if size is not None:
        from tts_cli.engine.random_model import random_encoders
        return random_encoders(size, device)
    from tts_cli.config_file import read_json
    from tts_cli.model.codec_encoder import load_codec_encoder
    from tts_cli.model.speaker_encoder import SpeakerEncoder, SpeakerEncoderConfig
    config_path = synth.ckpt.root / "config.json"
    config = SpeakerEncoderConfig.parse(read_json(config_path), config_path)
    speaker = SpeakerEncoder.from_state_dict(config, synth.ckpt.speaker_encoder_tensors(), device=device)
    return speaker, load_codec_encoder(synth.ckpt.speech_tokenizer_dir, device=device)


def bench_reference(synth, workload: str, size: str | None, seconds: float,
                    sentences: list[str]) -> tuple[VoiceReference | None, dict]:
    """The workload's reference voice (None for customvoice) and what to report of it."""
    from tts_cli.checkpoint import CUSTOM_VOICE
    from tts_cli.request import VoiceReference
    if model_kind(workload) == CUSTOM_VOICE:
        return None, {"workload": workload}
    if seconds < 1:
        raise ValueError(f"--ref-seconds {seconds:g}: a reference of at least 1 s (the speaker encoder's)")
    speaker, codec = encoders(synth, size)
    audio = synthetic_voice(seconds)
    start = time.perf_counter()
    # on the host, as tts synth's reference cache keeps them (so the prompts share a voice prefix too:
    # Prompt.voice_prefix reads no GPU tensor)
    embedding = speaker.embed(audio).float().cpu()
    codes = codec.encode(audio).cpu() if workload == "clone-icl" else None
    encode_s = time.perf_counter() - start
    text = transcript(sentences, seconds) if codes is not None else None
    reference = VoiceReference(speaker_embedding=embedding, codes=codes, text=text, name="synthetic voice")
    return reference, {
        "workload": workload, "ref_seconds": seconds, "ref_frames": None if codes is None else codes.shape[0],
        "ref_text_chars": None if text is None else len(text), "ref_encode_s": round(encode_s, 3),
        "ref_encoders": "random, released shapes" if size is not None else "the checkpoint's"}
