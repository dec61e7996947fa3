#!/usr/bin/env python
"""Golden fixtures for the speaker encoder and the codec encoder, recorded from the OFFICIAL
Qwen3-TTS code (PyPI `qwen-tts-hf`) on tiny random models built by the official classes.

Run (needs torch, transformers 5, qwen-tts-hf and, at record time only, librosa):

    PYTHONPATH=. /work/main/.venv/bin/python tools/make_encoder_golden.py

It writes, deterministically, tests/fixtures/golden/encoders/:

    encoders.safetensors   signal.<name> [T] fp32       the test signals (24 kHz, seeded noise + tones)
                           mel_filterbank [128, 513]    librosa.filters.mel as the official front end calls it
                           speaker.mels.<name> [1, F, 128]   official mel_spectrogram (fp32)
                           speaker.embedding.<name> [D]      official extract_speaker_embedding
                           codec.codes.<name> [frames, 16]   official Qwen3TTSTokenizer.encode, one clip per call
                           codec.batched_codes.<name>        the same, all three clips in one call
    encoders.json          configs, seeds, versions, the official speaker-encoder parameter shapes at the
                           real 1.7B / 0.6B Base dims, the official speech tokenizer's encoder.* names/shapes

Weights are not stored: every tensor is redrawn from its name (`seeded_tensor`), so the test draws
the same values for the module under test from its own parameter names. Configs:

- Speaker encoder: the official ECAPA-TDNN at small widths (channels [16, 16, 16, 16, 48], kernels
  and dilations as released, res2net scale 8, enc_dim 32), the official mel front end unchanged.
- Speech tokenizer: the Mimi encoder with the real strides (8, 6, 5, 4 -> 25 Hz, downsampled to
  12.5 Hz: 1920 samples per frame), small widths, 20 quantizers of which the official keeps 16,
  codebooks of the real size 2048; sliding_window 16 and max_position_embeddings 50 so that the
  official loader's full-attention override (window = max_position_embeddings) shows on the 3 s
  signal (75 frames at 25 Hz). The decoder half is the small one of tools/make_golden.py's 0.6b.

The signals: 1.3 s (16 frames + 480 samples), 2.0 s (25 frames exactly) and 3.0 s (37 frames + 960
samples), so that the last frame's partial window and the frame-count rule are both covered.
"""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import zlib
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = REPO_ROOT / "tests" / "fixtures" / "golden" / "encoders"
SAMPLE_RATE = 24000
WEIGHT_SEED = 43
SIGNAL_SEED = 2026
SIGNALS = {"short": 1.3, "even": 2.0, "long": 3.0}

SPEAKER_CONFIG = dict(mel_dim=128, enc_dim=32, enc_channels=[16, 16, 16, 16, 48], enc_kernel_sizes=[5, 3, 3, 3, 1],
                      enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=8, enc_res2net_scale=8,
                      enc_se_channels=8, sample_rate=24000)
# The released Base configs set only these (talker hidden size); the rest are the official defaults.
REAL_SPEAKER_CONFIGS = {"1.7b": dict(enc_dim=2048, sample_rate=24000), "0.6b": dict(enc_dim=1024, sample_rate=24000)}

CODEC_ENCODER_CONFIG = dict(
    sampling_rate=24000, frame_rate=12.5, audio_channels=1, hidden_size=32, num_filters=4,
    num_residual_layers=1, upsampling_ratios=[8, 6, 5, 4], kernel_size=7, last_kernel_size=3,
    residual_kernel_size=3, dilation_growth_rate=2, compress=2, codebook_size=2048, codebook_dim=16,
    vector_quantization_hidden_dimension=16, num_quantizers=20, num_semantic_quantizers=1, upsample_groups=8,
    num_hidden_layers=2, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    hidden_act="gelu", max_position_embeddings=50, sliding_window=16, rope_theta=10000.0,
    norm_eps=1e-5, layer_scale_initial_scale=0.01, use_causal_conv=True, pad_mode="constant", use_cache=False)
# The released speech tokenizer's encoder_config (its fields as quoted by ports of the published
# speech_tokenizer/config.json; the MimiConfig defaults otherwise): recorded as shapes only.
REAL_CODEC_ENCODER_CONFIG = dict(
    sampling_rate=24000, frame_rate=12.5, audio_channels=1, num_filters=64, kernel_size=7, residual_kernel_size=3,
    last_kernel_size=3, num_residual_layers=1, compress=2, upsampling_ratios=[8, 6, 5, 4], hidden_size=512,
    num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, head_dim=64, intermediate_size=2048,
    hidden_act="gelu", norm_eps=1e-5, layer_scale_initial_scale=0.01, rope_theta=10000.0,
    max_position_embeddings=8000, sliding_window=250, num_quantizers=32, num_semantic_quantizers=1,
    codebook_size=2048, codebook_dim=256, vector_quantization_hidden_dimension=256, pad_mode="constant",
    use_causal_conv=True)


# ---------------------------------------------------------------------------------------------
# Deterministic inputs (also used by tests/test_encoders.py)


def seeded_tensor(name: str, shape: tuple[int, ...], seed: int = WEIGHT_SEED) -> torch.Tensor:
    """The random value of one parameter or buffer, from its name alone: matrices and conv kernels
    N(0, 1/fan_in); codebook sums N(0, 1); cluster usage U(0.5, 2); norm weights 1 + N(0, 0.1);
    biases N(0, 0.02); layer scales N(0, 0.1); the Mimi `initialized` flags 1."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    leaf = name.rsplit(".", 1)[-1]
    normal = lambda std: torch.randn(shape, generator=gen) * std  # noqa: E731
    if leaf == "embed_sum":
        return normal(1.0)
    if leaf == "cluster_usage":
        return 0.5 + 1.5 * torch.rand(shape, generator=gen)
    if leaf == "initialized":
        return torch.ones(shape)
    if leaf == "scale":
        return normal(0.1)
    if leaf == "bias":
        return normal(0.02)
    if "norm" in name and leaf == "weight":
        return 1.0 + normal(0.1)
    if leaf == "weight" and len(shape) >= 2:
        return normal(math.prod(shape[1:]) ** -0.5)
    raise ValueError(f"no randomisation rule for {name} {tuple(shape)}")


def seeded_state(shapes: dict[str, torch.Size], seed: int = WEIGHT_SEED) -> dict[str, torch.Tensor]:
    return {name: seeded_tensor(name, tuple(shape), seed) for name, shape in shapes.items()}


def make_signal(seconds: float, seed: int) -> torch.Tensor:
    """float32 [seconds * 24000] in (-1, 1): three tones with slow amplitude envelopes over noise."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(round(seconds * SAMPLE_RATE), dtype=torch.float64) / SAMPLE_RATE
    wave = 0.05 * torch.randn(t.shape, generator=gen, dtype=torch.float64)
    for hz, amplitude in ((180.0, 0.3), (440.0, 0.2), (1250.0, 0.1)):
        phase = 2 * math.pi * torch.rand((), generator=gen, dtype=torch.float64)
        envelope = 0.6 + 0.4 * torch.sin(2 * math.pi * 1.7 * t + phase)
        wave += amplitude * envelope * torch.sin(2 * math.pi * hz * t + phase)
    return wave.to(torch.float32)


def signals() -> dict[str, torch.Tensor]:
    return {name: make_signal(seconds, SIGNAL_SEED + i) for i, (name, seconds) in enumerate(SIGNALS.items())}


def speech_tokenizer_config() -> dict:
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    import make_golden
    config = make_golden.speech_tokenizer_config("0.6b")
    return dict(config, encoder_config=dict(CODEC_ENCODER_CONFIG))


# ---------------------------------------------------------------------------------------------
# Recording


def _versions() -> dict[str, str | None]:
    import importlib.metadata as md
    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    for dist in ("transformers", "qwen-tts-hf", "librosa"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def record_speaker(waves: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    from qwen_tts.core.models import modeling_qwen3_tts as official
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSSpeakerEncoderConfig

    encoder = official.Qwen3TTSSpeakerEncoder(Qwen3TTSSpeakerEncoderConfig(**SPEAKER_CONFIG))
    shapes = {k: v.shape for k, v in encoder.state_dict().items()}
    encoder.load_state_dict(seeded_state(shapes), strict=True)
    encoder.eval()

    class Holder:  # what extract_speaker_embedding reads from the full model
        speaker_encoder, device, dtype = encoder, torch.device("cpu"), torch.float32

    tensors = {"mel_filterbank": torch.from_numpy(
        official.librosa_mel_fn(sr=24000, n_fft=1024, n_mels=128, fmin=0, fmax=12000)).float()}
    for name, wave in waves.items():
        audio = wave.numpy()
        tensors[f"speaker.mels.{name}"] = official.mel_spectrogram(
            torch.from_numpy(audio).unsqueeze(0), n_fft=1024, num_mels=128, sampling_rate=24000, hop_size=256,
            win_size=1024, fmin=0, fmax=12000).transpose(1, 2).contiguous()
        tensors[f"speaker.embedding.{name}"] = official.Qwen3TTSForConditionalGeneration.extract_speaker_embedding(
            Holder(), audio, 24000).float().contiguous()

    real = {}
    for variant, cfg in REAL_SPEAKER_CONFIGS.items():
        module = official.Qwen3TTSSpeakerEncoder(Qwen3TTSSpeakerEncoderConfig(**cfg))
        real[variant] = {"speaker_encoder_config": cfg,
                         "parameters": {k: list(v.shape) for k, v in module.state_dict().items()}}
    return tensors, real


def record_codec(waves: dict[str, torch.Tensor]) -> tuple[dict, dict, dict]:
    from qwen_tts import Qwen3TTSTokenizer
    from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model
    from safetensors import safe_open
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    import make_golden

    config = speech_tokenizer_config()
    torch.manual_seed(0)  # the decoder half keeps its construction-time values; encode never uses it
    fields = {k: v for k, v in config.items() if k != "model_type"}
    model = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(**fields))
    encoder_shapes = {k: v.shape for k, v in model.encoder.state_dict().items()}
    model.encoder.load_state_dict(seeded_state(encoder_shapes), strict=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)  # the official save: these are the names a real file holds
        with safe_open(os.path.join(tmp, "model.safetensors"), framework="pt") as f:
            saved = {k: list(f.get_slice(k).get_shape()) for k in sorted(f.keys()) if k.startswith("encoder.")}
        make_golden.write_json(Path(tmp) / "config.json", dict(config, transformers_version="4.57.3"))
        make_golden.write_json(Path(tmp) / "preprocessor_config.json", make_golden.SPEECH_PREPROCESSOR_CONFIG)
        tokenizer = Qwen3TTSTokenizer.from_pretrained(tmp, dtype=torch.float32)
        loaded = tokenizer.model.encoder.state_dict()
        bad = [k for k, v in seeded_state(encoder_shapes).items() if not torch.equal(loaded[k], v)]
        if bad:
            raise RuntimeError(f"the official loader changed {bad[:5]}")
        tensors = {f"codec.codes.{name}": tokenizer.encode(wave.numpy(), sr=SAMPLE_RATE).audio_codes[0].contiguous()
                   for name, wave in waves.items()}
        batched = tokenizer.encode([w.numpy() for w in waves.values()], sr=SAMPLE_RATE).audio_codes
        batch_note = {name: bool(torch.equal(codes, tensors[f"codec.codes.{name}"]))
                      for name, codes in zip(waves, batched)}
        tensors |= {f"codec.batched_codes.{name}": codes.contiguous() for name, codes in zip(waves, batched)}
        window = tokenizer.model.encoder.config.sliding_window

    real_config = dict(config, encoder_config=REAL_CODEC_ENCODER_CONFIG)  # the real encoder, the tiny decoder
    real_fields = {k: v for k, v in real_config.items() if k != "model_type"}
    real_encoder = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(**real_fields)).encoder
    real = {"speech_tokenizer_config": real_config,
            "encoder_tensors": {"encoder." + k: list(v.shape) for k, v in real_encoder.state_dict().items()}}
    return tensors, {"speech_tokenizer_config": config, "official_encoder_tensors": saved,
                     "loaded_sliding_window": window, "real_codec_encoder": real}, batch_note


def main() -> int:
    sys.path.insert(0, str(REPO_ROOT))
    from safetensors.torch import save_file
    from tts_cli.quality.reference import import_official
    import librosa  # noqa: F401  (record time only: the official front end calls librosa.filters.mel)
    import_official()

    torch.set_num_threads(1)
    waves = signals()
    speaker_tensors, real_speaker = record_speaker(waves)
    codec_tensors, codec_info, batch_note = record_codec(waves)
    tensors = {f"signal.{k}": v for k, v in waves.items()} | speaker_tensors | codec_tensors
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(OUT_DIR / "encoders.safetensors"), metadata={"format": "pt"})
    info = {
        "recorded_with": _versions(),
        "weight_seed": WEIGHT_SEED, "signal_seed": SIGNAL_SEED, "signals_seconds": SIGNALS,
        "speaker_encoder_config": SPEAKER_CONFIG,
        "real_speaker_encoders": real_speaker,
        **codec_info,
        "batched_encode_equals_single": batch_note,
    }
    (OUT_DIR / "encoders.json").write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    size = sum(p.stat().st_size for p in OUT_DIR.iterdir())
    print(f"wrote {OUT_DIR} ({size / 1e6:.2f} MB); batched encode equals single: {batch_note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
