"""`random:1.7b` / `random:0.6b`: models with the exact real shapes and random weights, built on
the target device in seconds (no download), for measuring speed. Speed does not depend on the
weight values; audio from them is noise, and they never draw EOS on purpose, so benchmarks force
every request's length. CustomVoice by default; the Base variant (voice cloning) has the released
Base config's speaker encoder and the speech tokenizer's encoder (random_encoders), and no speakers.

Text goes through the bundled tiny BPE tokenizer (its ids are valid rows of the real 151936-row
text table); it splits text into about twice as many tokens as the real Qwen tokenizer, so
prompts are longer than real ones (prefill cost and KV length are overstated, not understated).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tts_cli.checkpoint import BASE, CUSTOM_VOICE, ModelConfig
from tts_cli.model.codec import CodecConfig, CodecDecoder
from tts_cli.model.qwen3_tts import Qwen3TTS

TINY = Path(__file__).resolve().parents[1] / "assets" / "tiny-1.7b-customvoice"

# Real config values (shared/docs/qwen3-tts-spec.md sec. 1.4, 1.5, 1.7).
CODE_PREDICTOR = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=5, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000,
                      vocab_size=2048, num_code_groups=16)
TALKERS = {
    "1.7b": dict(hidden_size=2048, intermediate_size=6144),
    "0.6b": dict(hidden_size=1024, intermediate_size=3072),
}
TALKER_COMMON = dict(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                     rms_norm_eps=1e-6, rope_theta=1000000, vocab_size=3072, text_vocab_size=151936,
                     text_hidden_size=2048, num_code_groups=16)
CODEC = dict(latent_dim=1024, codebook_dim=512, codebook_size=2048, num_quantizers=16, decoder_dim=1536,
             hidden_size=512, intermediate_size=1024, head_dim=64, num_attention_heads=16,
             num_key_value_heads=16, num_hidden_layers=8, rms_norm_eps=1e-5, rope_theta=10000,
             sliding_window=72, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], hidden_act="silu")
SIZES = {"1.7b": "1b7", "0.6b": "0b6"}


def parse_spec(spec: str) -> str | None:
    """'random:1.7b' -> '1.7b'; anything else -> None."""
    if not spec.startswith("random:"):
        return None
    size = spec.split(":", 1)[1]
    if size not in TALKERS:
        raise ValueError(f"unknown random model '{spec}'; use random:1.7b or random:0.6b")
    return size


def random_config(size: str, kind: str = CUSTOM_VOICE) -> ModelConfig:
    """The real config of that size and kind (CUSTOM_VOICE or BASE), with the tiny tokenizer's text
    special ids."""
    data = json.loads((TINY / "config.json").read_text())
    data["tts_model_size"] = SIZES[size]
    data["talker_config"].update(TALKER_COMMON, **TALKERS[size])
    data["talker_config"]["code_predictor_config"].update(CODE_PREDICTOR)
    if kind == BASE:
        data["tts_model_type"] = BASE
        data["talker_config"].update(spk_id={}, spk_is_dialect={})
        # the released Base configs give enc_dim (the talker's width) and the sample rate only
        data["speaker_encoder_config"] = {"enc_dim": TALKERS[size]["hidden_size"], "sample_rate": 24000}
    elif kind != CUSTOM_VOICE:
        raise ValueError(f"random models are CustomVoice or Base, not {kind!r}")
    return ModelConfig.parse(data, Path(f"random:{size}"))


@torch.no_grad()
def _randomize(module: torch.nn.Module, generator: torch.Generator) -> None:
    for name, p in module.named_parameters():
        if p.dim() >= 2:
            p.normal_(0.0, 0.02, generator=generator)
        elif name.endswith("bias"):
            p.zero_()
        else:  # norm weights, scales, Snake parameters
            p.fill_(1.0 if "norm" in name else 0.1)


def build_random(size: str, device, dtype, seed: int = 0, kind: str = CUSTOM_VOICE):
    """(model, codec) with random weights on `device`: the talker and code predictor in `dtype` (for
    float16: bf16 values converted, as a real checkpoint loads), the codec in fp32 (as the real speech
    tokenizer is stored and as `tts synth` runs it)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        model = Qwen3TTS(random_config(size, kind)).to(torch.bfloat16 if dtype == torch.float16 else dtype)
        codec_cfg = CodecConfig.parse({"output_sample_rate": 24000, "decoder_config": CODEC}, Path("random codec"))
        codec = CodecDecoder(codec_cfg)
    _randomize(model, generator)
    model = model.to(dtype)
    _randomize(codec, generator)
    tables = codec.quantizer.tables
    codec.quantizer.tables = torch.randn(tables.shape, generator=generator, device=device) * 0.02
    return model.eval().requires_grad_(False), codec.eval().requires_grad_(False)


@torch.no_grad()
def random_encoders(size: str, device, seed: int = 0):
    """(speaker encoder, codec encoder) of the released shapes (the Base config's speaker encoder
    of that size, the speech tokenizer's encoder), random weights, fp32 on `device`: what a Base
    checkpoint encodes a reference with. Codebooks random too, so the codes spread over the range."""
    from tts_cli.model.codec_encoder import CodecEncoder, CodecEncoderConfig
    from tts_cli.model.speaker_encoder import SpeakerEncoder, SpeakerEncoderConfig
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        speaker = SpeakerEncoder(SpeakerEncoderConfig(enc_dim=TALKERS[size]["hidden_size"]))
        codec = CodecEncoder(CodecEncoderConfig())
    for module in (speaker, codec):
        _randomize(module, generator)
    for name, buffer in codec.named_buffers():
        if name.endswith("embed_sum"):
            buffer.normal_(0.0, 1.0, generator=generator)
    return speaker.eval().requires_grad_(False), codec.eval().requires_grad_(False)
