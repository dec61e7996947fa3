"""Cloned and designed voices for the engine tests (tests/test_engine_clone.py on CPU,
tests/test_gpu.py on CUDA): references of random codes and a random x-vector, which is all the
engine sees of a reference (the encoders are held to the official code in tests/test_encoders.py)."""
from pathlib import Path

import torch

from tts_cli.request import Request, VoiceReference

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TINY_BASE = FIXTURES / "tiny-1.7b-base"
TINY_BASE_06 = FIXTURES / "tiny-0.6b-base"
TINY_VOICE_DESIGN = FIXTURES / "tiny-1.7b-voicedesign"
TEXTS = ["The birch canoe slid on the smooth planks.", "Glue the sheet to the dark blue background.",
         "It's easy to tell the depth of a well.", "These days a chicken leg is a rare dish.",
         "Rice is often served in round bowls.", "The juice of lemons makes fine punch."]
# 15 reference frames followed by 11 generated ones: the official cut lands one sample before the
# frame boundary (tts_cli.synthesizer.icl_cut), so the output keeps the reference's last sample.
SHORT_REFERENCE, CUT_KEEPS_A_SAMPLE = 15, 11


def random_reference(cfg, frames: int | None, seed: int, text: str = "Hello there, this is how I sound.",
                     name: str = "") -> VoiceReference:
    """A reference of `frames` random codes (None: x-vector only) and a random x-vector."""
    g = torch.Generator().manual_seed(seed)
    codes = None if frames is None else torch.randint(0, cfg.code_vocab_size, (frames, cfg.num_code_groups),
                                                      generator=g)
    return VoiceReference(speaker_embedding=torch.randn(cfg.talker.hidden_size, generator=g), codes=codes,
                          text=text, name=name)


def clone_requests(cfg, long_frames: int) -> list[Request]:
    """Every kind of Base row, mixed: ICL and x-vector only, each in both text modes (None: the
    official default, the streaming text mode), a short ICL reference and a long one (whose prompt
    spans several of the prefill's rounds), two rows sharing each reference."""
    short = random_reference(cfg, SHORT_REFERENCE, 1, name="short")
    long = random_reference(cfg, long_frames, 2, text="A longer reference, read slowly and with care, "
                                                      "sentence after sentence.", name="long")
    x_vector = random_reference(cfg, None, 3, name="x-vector")
    cases = [(short, None), (long, True), (x_vector, None), (x_vector, True), (short, True), (long, None)]
    return [Request(id=f"{ref.name}-{'streaming' if mode is None else 'non-streaming'}", text=TEXTS[i],
                    reference=ref, non_streaming_mode=mode, seed=10 + i, language="english" if i % 2 else "auto")
            for i, (ref, mode) in enumerate(cases)]


def design_requests() -> list[Request]:
    """VoiceDesign rows in both text modes (the official default is the non-streaming one)."""
    voices = ["A calm, deep male voice, speaking slowly.", "A bright young female voice, cheerful and quick."]
    return [Request(id=f"design-{i}", text=TEXTS[i], instruct=voices[i % 2], seed=20 + i,
                    non_streaming_mode=None if i % 2 else False) for i in range(4)]
