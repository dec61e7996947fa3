#!/usr/bin/env python
"""Golden fixtures recorded from the OFFICIAL Qwen3-TTS 12 Hz implementation (PyPI `qwen-tts-hf`).

Run (needs the reference environment: torch, transformers 5, qwen-tts-hf installed --no-deps):

    /work/refenv/bin/python tools/make_golden.py            # both checkpoints, ~30 s on 2 CPU cores
    python tools/make_golden.py --build 1.7b-real --ckpt DIR  # one random checkpoint only, no records

It writes, deterministically (a re-run rewrites identical bytes):

    tts_cli/assets/tiny-1.7b-customvoice/           tiny random CustomVoice checkpoint, tts_model_size "1b7"
    tests/fixtures/tiny-0.6b-customvoice/           tiny random CustomVoice checkpoint, tts_model_size "0b6"
    tests/fixtures/tiny-1.7b-base/                  tiny random Base checkpoints (speaker encoder included),
    tests/fixtures/tiny-0.6b-base/                    "1b7" and "0b6"
    tests/fixtures/tiny-1.7b-voicedesign/           tiny random VoiceDesign checkpoint, "1b7"
    tts_cli/assets/golden/tiny-1.7b-customvoice/    records.safetensors + records.json
    tests/fixtures/golden/tiny-*/                   records of the other four
    tests/fixtures/reference-voice-24k.wav          the reference voice the Base records clone (16-bit)

1. Text tokenizer (`build_tokenizer`): a byte-level BPE trained with `tokenizers` on the Harvard
   sentences plus a few lines of other languages and the chat-template words, with the Qwen2
   pre-tokenizer (NFC, the Qwen2 split regex, ByteLevel); ids 0..255 are the 256 byte symbols in
   GPT-2 order, then one id per merge. The 33 Qwen special tokens follow in the order of the real
   Qwen vocabulary (<|endoftext|> = BPE size, <tts_pad> = BPE size + 28, ...). Saved like the
   official checkpoint: vocab.json, merges.txt, tokenizer_config.json (no tokenizer.json).
2. Checkpoints (`build_checkpoint`): the official classes (`Qwen3TTSForConditionalGeneration`,
   `Qwen3TTSTokenizerV2Model`) built from configs with every real id/table (codec specials,
   languages with dialects, speakers, vocab 3072, 16 code groups, codebook 2048, upsampling
   [8,5,4,3] x [2,2], window 72) and tiny widths (`VARIANTS`). Weights are redrawn from a fixed
   seed: >= 2-D tensors N(0, 1/fan_in) (lookup tables and codebooks N(0, 1)), the codec's
   residual-unit output convs x0.2 and its final conv x0.05; norm weights 1 + N(0, 0.1); biases
   N(0, 0.02); LayerScale scales, ConvNeXt gammas and SnakeBeta alpha/beta N(0, 0.1); codebook
   cluster_usage U(0.5, 2). The main model is stored in bf16, the speech tokenizer in fp32, like the
   real files. (A flat N(0, 0.02) for every matrix, as in shared/peer_bench/build_ckpt.py, makes
   useless fixtures at these widths: the biases swamp the 0.02-scale embeddings, so the code
   predictor emits nearly the same codes every frame and the waveform does not depend on the codes
   at all, 1e-9 apart for different inputs. With fan-in scaling every signal is O(1), the logits
   are ~N(0, 1) and the waveform has an RMS of ~0.2 without clipping.)
   Base and VoiceDesign checkpoints have the real files' tables (no speakers, no dialect languages).
   A Base checkpoint adds the speaker encoder (ECAPA-TDNN at TINY_SPEAKER_ENCODER widths, its
   x-vector talker-wide), drawn after the rest by the same rules, and its codec_head row of EOS is
   scaled by BASE_EOS_LOGIT_GAIN. The speech tokenizer, encoder included (a tiny Mimi: 16
   quantizers of 16 codes), is the same in every kind.

3. Records: `tts_cli.quality.reference.record` runs the official code on each checkpoint (its
   docstring lists what is recorded); `write_golden` stores them.

A test can import this file (`sys.path.insert(0, "tools"); import make_golden`; it needs `qwen_tts`
importable) and call `build_checkpoint(dir, "1.7b")` without touching the files written here.
Importing it sets RAYON_NUM_THREADS=1, TOKENIZERS_PARALLELISM=false and
HF_HUB_OFFLINE=1 unless already set. The tokenizer corpus is ../shared/data/harvard-lists-01-36.txt
next to the repository (--corpus to override); recording needs no corpus.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Before tokenizers / transformers load: single-threaded BPE training (deterministic merges) and no
# network lookups from the Hub helpers.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's tts_cli, run as a script
from tts_cli.quality.reference import (  # noqa: E402
    FORCED_FRAMES, FORCED_FRAMES_VOICES, QWEN_SPECIAL_TOKENS, import_official, record, reference_voice, stub_missing_audio_modules,
    write_golden, write_json)

REPO_ROOT = Path(__file__).resolve().parents[1]
# The bundled copy of shared/data/harvard-lists-01-36.txt (byte-identical): present on any checkout.
DEFAULT_CORPUS = REPO_ROOT / "tts_cli" / "assets" / "harvard-sentences.txt"

# (name, variant, tts_model_type, checkpoint dir, golden dir), relative to the repository root.
TARGETS = (
    ("1.7b", "1.7b", "custom_voice", "tts_cli/assets/tiny-1.7b-customvoice",
     "tts_cli/assets/golden/tiny-1.7b-customvoice"),
    ("0.6b", "0.6b", "custom_voice", "tests/fixtures/tiny-0.6b-customvoice",
     "tests/fixtures/golden/tiny-0.6b-customvoice"),
    ("1.7b-base", "1.7b", "base", "tests/fixtures/tiny-1.7b-base", "tests/fixtures/golden/tiny-1.7b-base"),
    ("0.6b-base", "0.6b", "base", "tests/fixtures/tiny-0.6b-base", "tests/fixtures/golden/tiny-0.6b-base"),
    ("1.7b-voicedesign", "1.7b", "voice_design", "tests/fixtures/tiny-1.7b-voicedesign",
     "tests/fixtures/golden/tiny-1.7b-voicedesign"),
)
REFERENCE_VOICE_FILE = "tests/fixtures/reference-voice-24k.wav"

WEIGHT_SEED = {"1.7b": 17, "0.6b": 6, "1.7b-real": 17}
SPEECH_TOKENIZER_SEED = 1920
RESIDUAL_OUT_GAIN = 0.2  # codec residual-unit output convs (see codec_output_gains)
# Base checkpoints: the codec_head row of EOS scaled up, so that unforced rows end by EOS within
# tens of frames in every clone mode (at gain 1 the tiny 0.6B Base drew no EOS in 160 frames of
# any of its four prompts), and the records show the official EOS rule in each.
BASE_EOS_LOGIT_GAIN = 1.8
FINAL_CONV_GAIN = 0.05   # codec final conv
WEIGHTS_NOTE = ("random, fixed seeds: >=2-D tensors N(0, 1/fan_in) (lookup tables N(0, 1)); codec residual-unit "
                "output convs x0.2 and final conv x0.05; norm weights 1+N(0, 0.1); biases N(0, 0.02); LayerScale "
                "scales, ConvNeXt gammas, SnakeBeta alpha/beta N(0, 0.1); cluster_usage U(0.5, 2). Main model "
                "stored bf16, speech tokenizer fp32.")



# ---------------------------------------------------------------------------------------------
# 2. Tiny Qwen2-compatible text tokenizer
# ---------------------------------------------------------------------------------------------

BPE_VOCAB_SIZE = 1000  # 256 byte symbols + 744 merges
TEXT_VOCAB_SIZE = 1088  # embedding rows: the 1033 tokenizer ids rounded up to a multiple of 64

# Qwen2's pre-tokenizer split (transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX).
QWEN2_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                     r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

EXTRA_CORPUS = (
    "今天天气很好，我们去公园散步吧。",
    "你好，欢迎使用语音合成系统。",
    "北京的秋天是一年中最美的季节。",
    "我们明天早上八点在学校门口见面。",
    "今日はとても良い天気ですね。",
    "안녕하세요, 만나서 반갑습니다.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Le petit chat dort sur le canapé depuis ce matin.",
    "El perro corre rápidamente por el parque verde.",
    "Il treno parte dalla stazione alle otto di sera.",
    "O menino comeu o bolo inteiro sozinho.",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "Speak slowly and calmly.",
    "Read this with a cheerful, energetic voice.",
)
# The chat-template words, repeated so that each becomes one BPE token.
TEMPLATE_WORDS = ("assistant", "user", "system")
TEMPLATE_REPEATS = 40


def _read_corpus(corpus: Path) -> list[str]:
    if not Path(corpus).is_file():
        raise FileNotFoundError(f"tokenizer corpus not found: {corpus} (pass --corpus)")
    lines = [line.strip() for line in Path(corpus).read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line]


def train_bpe(lines: list[str], vocab_size: int = BPE_VOCAB_SIZE):
    """A `tokenizers.Tokenizer` with Qwen2's normalizer, pre-tokenizer and decoder, BPE-trained."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"BPE training gave {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok


def _tokenizer_config(bpe_size: int) -> dict:
    """tokenizer_config.json in the style of the published Qwen2/Qwen3 files."""
    added = {str(bpe_size + i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                                 "single_word": False, "special": special}
             for i, (token, special) in enumerate(QWEN_SPECIAL_TOKENS)}
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t, special in QWEN_SPECIAL_TOKENS
                                      if special and t != "<|endoftext|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def build_tokenizer(out_dir: str | Path, corpus: str | Path = DEFAULT_CORPUS) -> dict[str, int]:
    """Write vocab.json, merges.txt and tokenizer_config.json into out_dir; return the ids that the
    checkpoint config needs (and the tests may want): special tokens, "assistant", "\\n", sizes."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = _read_corpus(corpus) + list(EXTRA_CORPUS) + [w for w in TEMPLATE_WORDS for _ in range(TEMPLATE_REPEATS)]
    bpe = train_bpe(lines)
    bpe.model.save(str(out_dir))  # vocab.json + merges.txt ("#version: 0.2" header, like Qwen2's)
    (out_dir / "tokenizer.json").unlink(missing_ok=True)
    write_json(out_dir / "tokenizer_config.json", _tokenizer_config(BPE_VOCAB_SIZE))

    vocab = bpe.get_vocab()
    ids = {token: BPE_VOCAB_SIZE + i for i, (token, _) in enumerate(QWEN_SPECIAL_TOKENS)}
    for word in TEMPLATE_WORDS:
        if word not in vocab:
            raise RuntimeError(f"the chat-template word {word!r} is not a single BPE token")
        ids[word] = vocab[word]
    ids["\n"] = vocab["Ċ"]  # the byte-level symbol of "\n"
    ids["bpe_vocab_size"] = BPE_VOCAB_SIZE
    ids["vocab_size"] = BPE_VOCAB_SIZE + len(QWEN_SPECIAL_TOKENS)
    return ids



# ---------------------------------------------------------------------------------------------
# 3. Tiny random checkpoints in the official layout
# ---------------------------------------------------------------------------------------------

# Real 1.7B/0.6B-CustomVoice tables (shared/docs/qwen3-tts-spec.md sec. 1.4).
SPK_ID = {"serena": 3066, "vivian": 3065, "uncle_fu": 3010, "ryan": 3061, "aiden": 2861,
          "ono_anna": 2873, "sohee": 2864, "eric": 2875, "dylan": 2878}
SPK_IS_DIALECT = {**{name: False for name in SPK_ID}, "eric": "sichuan_dialect", "dylan": "beijing_dialect"}
CODEC_LANGUAGE_ID = {"chinese": 2055, "english": 2050, "german": 2053, "italian": 2070,
                     "portuguese": 2071, "spanish": 2054, "japanese": 2058, "korean": 2064,
                     "french": 2061, "russian": 2069, "beijing_dialect": 2074, "sichuan_dialect": 2062}
CODEC_SPECIAL_IDS = dict(codec_pad_id=2148, codec_bos_id=2149, codec_eos_token_id=2150, codec_think_id=2154,
                         codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157)
# Real checkpoints ship max_new_tokens 8192. The tiny random models seldom draw EOS, so every
# row would run to that cap: 101 tokens (100 frames, 8 s of noise) keeps demos and tests short.
TINY_MAX_NEW_TOKENS = 101
GENERATION_CONFIG = {"do_sample": True, "temperature": 0.9, "top_k": 50, "top_p": 1.0,
                     "repetition_penalty": 1.05, "subtalker_dosample": True, "subtalker_temperature": 0.9,
                     "subtalker_top_k": 50, "subtalker_top_p": 1.0, "max_new_tokens": TINY_MAX_NEW_TOKENS}
PREPROCESSOR_CONFIG = {"padding_side": "left", "padding_value": 0.0, "processor_class": "Qwen3TTSProcessor",
                       "return_attention_mask": True}
SPEECH_PREPROCESSOR_CONFIG = {"chunk_length_s": None, "feature_extractor_type": "EncodecFeatureExtractor",
                              "feature_size": 1, "overlap": None, "padding_side": "right", "padding_value": 0.0,
                              "return_attention_mask": True, "sampling_rate": 24000}
CONFIG_TRANSFORMERS_VERSION = "4.57.3"  # what the published config.json files say


@dataclass(frozen=True)
class Variant:
    tts_model_size: str
    talker_hidden: int
    talker_intermediate: int = 64
    talker_layers: int = 2
    talker_heads: int = 4
    talker_kv_heads: int = 2
    talker_head_dim: int = 16
    mrope_section: tuple[int, int, int] = (2, 3, 3)  # sums to talker_head_dim / 2, like [24, 20, 20]
    text_hidden: int = 24
    cp_hidden: int = 16
    cp_intermediate: int = 32
    cp_layers: int = 2
    cp_heads: int = 4
    cp_kv_heads: int = 2
    cp_head_dim: int = 8
    codec: tuple[tuple[str, int], ...] = (   # speech-tokenizer decoder widths
        ("codebook_dim", 16), ("latent_dim", 32), ("decoder_dim", 32), ("hidden_size", 32),
        ("intermediate_size", 64), ("num_hidden_layers", 2), ("num_attention_heads", 4),
        ("num_key_value_heads", 4), ("head_dim", 8))


VARIANTS = {
    "1.7b": Variant(tts_model_size="1b7", talker_hidden=32),  # small_to_mtp_projection 32 -> 16
    "0.6b": Variant(tts_model_size="0b6", talker_hidden=16),  # talker width == CP width: identity
    # The real 1.7B CustomVoice shapes (shared/docs/qwen3-tts-spec.md), for speed comparisons with
    # the official code (tools/side_by_side.py) and for `tts verify-golden --dtype bfloat16` on the GPU
    # (tools/verify_golden_gpu.sh records golden records of it there; none are stored here).
    "1.7b-real": Variant(
        tts_model_size="1b7", talker_hidden=2048, talker_intermediate=6144, talker_layers=28, talker_heads=16,
        talker_kv_heads=8, talker_head_dim=128, mrope_section=(24, 20, 20), text_hidden=2048, cp_hidden=1024,
        cp_intermediate=3072, cp_layers=5, cp_heads=16, cp_kv_heads=8, cp_head_dim=128,
        codec=(("codebook_dim", 512), ("latent_dim", 1024), ("decoder_dim", 1536), ("hidden_size", 512),
               ("intermediate_size", 1024), ("num_hidden_layers", 8), ("num_attention_heads", 16),
               ("num_key_value_heads", 16), ("head_dim", 64))),
}


# The Base speaker encoder at tiny widths (the real one: enc_channels [512, 512, 512, 512, 1536],
# attention 128, SE 128, res2net scale 8; the 128 mel bins are fixed by extract_speaker_embedding).
TINY_SPEAKER_ENCODER = dict(enc_channels=[16, 16, 16, 16, 48], enc_kernel_sizes=[5, 3, 3, 3, 1],
                            enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=8, enc_res2net_scale=8,
                            enc_se_channels=8, sample_rate=24000)


def model_config(variant: str, ids: dict[str, int], kind: str = "custom_voice") -> dict:
    """config.json of a tiny checkpoint of the given tts_model_type (structure and tables of the
    real file: Base and VoiceDesign have no speakers and no dialects; Base has a speaker encoder
    whose x-vector is talker-wide)."""
    v = VARIANTS[variant]
    named_speakers = kind == "custom_voice"
    languages = {k: i for k, i in CODEC_LANGUAGE_ID.items() if named_speakers or "dialect" not in k}
    code_predictor = dict(
        hidden_size=v.cp_hidden, intermediate_size=v.cp_intermediate, num_hidden_layers=v.cp_layers,
        num_attention_heads=v.cp_heads, num_key_value_heads=v.cp_kv_heads, head_dim=v.cp_head_dim,
        hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000, rope_scaling=None,
        max_position_embeddings=65536, vocab_size=2048, num_code_groups=16,
        layer_types=["full_attention"] * v.cp_layers, use_sliding_window=False, sliding_window=None,
        max_window_layers=v.cp_layers, attention_bias=False, attention_dropout=0.0, initializer_range=0.02,
        use_cache=True, tie_word_embeddings=False)
    talker = dict(
        vocab_size=3072, hidden_size=v.talker_hidden, intermediate_size=v.talker_intermediate,
        num_hidden_layers=v.talker_layers, num_attention_heads=v.talker_heads,
        num_key_value_heads=v.talker_kv_heads, head_dim=v.talker_head_dim, hidden_act="silu",
        rms_norm_eps=1e-6, rope_theta=1000000,
        rope_scaling={"interleaved": True, "mrope_section": list(v.mrope_section), "rope_type": "default"},
        max_position_embeddings=32768, text_vocab_size=TEXT_VOCAB_SIZE, text_hidden_size=v.text_hidden,
        num_code_groups=16, position_id_per_seconds=13, use_sliding_window=False, sliding_window=None,
        attention_bias=False, attention_dropout=0.0, initializer_range=0.02, use_cache=True,
        tie_word_embeddings=False, **CODEC_SPECIAL_IDS,
        codec_language_id=languages, spk_id=dict(SPK_ID) if named_speakers else {},
        spk_is_dialect=dict(SPK_IS_DIALECT) if named_speakers else {},
        code_predictor_config=code_predictor)
    speaker_encoder = ({"speaker_encoder_config": dict(enc_dim=v.talker_hidden, **TINY_SPEAKER_ENCODER)}
                       if kind == "base" else {})
    return dict(
        architectures=["Qwen3TTSForConditionalGeneration"], model_type="qwen3_tts",
        tts_model_type=kind, tts_model_size=v.tts_model_size, tokenizer_type="qwen3_tts_tokenizer_12hz",
        im_start_token_id=ids["<|im_start|>"], im_end_token_id=ids["<|im_end|>"],
        assistant_token_id=ids["assistant"], tts_pad_token_id=ids["<tts_pad>"],
        tts_bos_token_id=ids["<tts_text_bos>"], tts_eos_token_id=ids["<tts_text_eod>"],
        **speaker_encoder, talker_config=talker, torch_dtype="bfloat16")


def speech_tokenizer_config(variant: str) -> dict:
    """speech_tokenizer/config.json: the real decoder structure at the variant's widths, and a Mimi
    encoder (never used for synthesis, but built by the official loader) at the smallest practical size."""
    w = dict(VARIANTS[variant].codec)
    decoder = dict(   # key order as in the published file
        codebook_size=2048, codebook_dim=w["codebook_dim"], num_quantizers=16, num_semantic_quantizers=1,
        semantic_codebook_size=4096, latent_dim=w["latent_dim"], decoder_dim=w["decoder_dim"],
        hidden_size=w["hidden_size"], intermediate_size=w["intermediate_size"],
        num_hidden_layers=w["num_hidden_layers"], num_attention_heads=w["num_attention_heads"],
        num_key_value_heads=w["num_key_value_heads"], head_dim=w["head_dim"], hidden_act="silu",
        rms_norm_eps=1e-5, rope_theta=10000, sliding_window=72, max_position_embeddings=8000,
        layer_scale_initial_scale=0.01, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2],
        attention_bias=False, attention_dropout=0.0)
    encoder = dict(
        rope_theta=10000.0, sampling_rate=24000, frame_rate=12.5, audio_channels=1,
        hidden_size=8, num_filters=2, num_residual_layers=1, upsampling_ratios=[8, 6, 5, 4],
        codebook_size=16, codebook_dim=4, vector_quantization_hidden_dimension=4, num_quantizers=16,
        num_semantic_quantizers=1, upsample_groups=8, num_hidden_layers=1, intermediate_size=16,
        num_attention_heads=2, num_key_value_heads=2, head_dim=4, use_causal_conv=True, use_cache=False)
    return dict(
        architectures=["Qwen3TTSTokenizerV2Model"], model_type="qwen3_tts_tokenizer_12hz",
        input_sample_rate=24000, output_sample_rate=24000, decode_upsample_rate=1920,
        encode_downsample_rate=1920, encoder_valid_num_quantizers=16,
        encoder_config=encoder, decoder_config=decoder)


def _fan_in(module: torch.nn.Module) -> float:
    """Inputs feeding one output value of a weight tensor's module (1 for lookup tables)."""
    nn = torch.nn
    if isinstance(module, nn.Linear):
        return module.in_features
    if isinstance(module, nn.ConvTranspose1d):
        return module.in_channels * module.kernel_size[0] / module.stride[0]
    if isinstance(module, nn.Conv1d):
        return module.in_channels // module.groups * module.kernel_size[0]
    if isinstance(module, nn.Embedding) or type(module).__name__ == "EuclideanCodebook":
        return 1.0
    raise ValueError(f"no fan-in rule for {type(module).__name__}")


def _random_value(name: str, module: torch.nn.Module, shape: torch.Size, gen: torch.Generator,
                  gain: float = 1.0) -> torch.Tensor:
    """The fixed-seed value of one parameter (see the module docstring for the scheme)."""
    leaf = name.rsplit(".", 1)[-1]
    kind = type(module).__name__
    normal = lambda std: torch.randn(shape, generator=gen) * std  # noqa: E731
    if len(shape) >= 2:
        return normal(gain * _fan_in(module) ** -0.5)
    if leaf == "cluster_usage":
        return 0.5 + 1.5 * torch.rand(shape, generator=gen)
    if leaf in ("alpha", "beta") and kind == "SnakeBeta":
        return normal(0.1)
    if leaf == "bias":
        return normal(0.02)
    if leaf == "weight" and "Norm" in kind:
        return 1.0 + normal(0.1)
    if leaf in ("scale", "gamma"):  # LayerScale (codec transformer, Mimi) and ConvNeXt gamma
        return normal(0.1)
    raise ValueError(f"no randomisation rule for parameter {name} ({kind}, shape {tuple(shape)})")


def randomize_(model: torch.nn.Module, seed: int, gains: dict[torch.nn.Module, float] | None = None) -> None:
    """Redraw every parameter of `model` in place from one generator (parameter order is fixed);
    `gains` scales the weight std of some modules."""
    gen = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    gains = gains or {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            owner = modules[name.rpartition(".")[0]]
            value = _random_value(name, owner, param.shape, gen, gains.get(owner, 1.0))
            param.copy_(value.to(param.dtype))


def codec_output_gains(codec: torch.nn.Module) -> dict[torch.nn.Module, float]:
    """Quieter output convs of the codec's 12 residual units (x0.2) and of its final conv (x0.05):
    with unit-gain residual branches the signal grows ~100x through the SnakeBeta blocks and the
    waveform clips at +-1 almost everywhere."""
    gains = {m.conv2.conv: RESIDUAL_OUT_GAIN for m in codec.decoder.modules()
             if type(m).__name__ == "Qwen3TTSTokenizerV2DecoderDecoderResidualUnit"}
    gains[codec.decoder.decoder[-1].conv] = FINAL_CONV_GAIN
    return gains



def _save_weights(model: torch.nn.Module, path: Path, dtype: torch.dtype) -> int:
    """model.safetensors with the state_dict keys (e.g. talker.model.layers.0...). Not
    save_pretrained: under transformers 5 it trips over the package's v4-style _tied_weights_keys."""
    from safetensors.torch import save_file
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path), metadata={"format": "pt"})
    return len(state)


CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors", "preprocessor_config.json",
                    "vocab.json", "merges.txt", "tokenizer_config.json")
SPEECH_TOKENIZER_FILES = ("config.json", "model.safetensors", "preprocessor_config.json")


def build_checkpoint(out_dir: str | Path, variant: str, corpus: str | Path = DEFAULT_CORPUS,
                     kind: str = "custom_voice") -> dict[str, int]:
    """Write a tiny random checkpoint ("1.7b" or "0.6b"; tts_model_type `kind`) into out_dir, in the
    official layout; returns the tokenizer ids (see build_tokenizer). The talker, code predictor and
    speech tokenizer draw the same values for every kind (a Base model's speaker encoder is drawn
    after them), so a VoiceDesign checkpoint's weight files equal the CustomVoice ones."""
    import_official()
    from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = build_tokenizer(out_dir, corpus)

    cfg = model_config(variant, ids, kind)
    torch.manual_seed(0)  # construction-time init; every parameter is redrawn below anyway
    model = Qwen3TTSForConditionalGeneration(Qwen3TTSConfig(**{k: v for k, v in cfg.items() if k != "model_type"}))
    randomize_(model, WEIGHT_SEED[variant])
    if kind == "base":
        with torch.no_grad():
            model.talker.codec_head.weight[cfg["talker_config"]["codec_eos_token_id"]] *= BASE_EOS_LOGIT_GAIN
    write_json(out_dir / "config.json", dict(cfg, transformers_version=CONFIG_TRANSFORMERS_VERSION))
    _save_weights(model, out_dir / "model.safetensors", torch.bfloat16)
    write_json(out_dir / "generation_config.json", GENERATION_CONFIG)
    write_json(out_dir / "preprocessor_config.json", PREPROCESSOR_CONFIG)

    st_dir = out_dir / "speech_tokenizer"
    st_dir.mkdir(exist_ok=True)
    st_cfg = speech_tokenizer_config(variant)
    torch.manual_seed(0)
    codec = Qwen3TTSTokenizerV2Model(
        Qwen3TTSTokenizerV2Config(**{k: v for k, v in st_cfg.items() if k != "model_type"}))
    randomize_(codec, SPEECH_TOKENIZER_SEED, codec_output_gains(codec))
    write_json(st_dir / "config.json", dict(st_cfg, transformers_version=CONFIG_TRANSFORMERS_VERSION))
    _save_weights(codec, st_dir / "model.safetensors", torch.float32)
    write_json(st_dir / "preprocessor_config.json", SPEECH_PREPROCESSOR_CONFIG)

    unexpected = sorted({p.name for p in out_dir.iterdir()} - set(CHECKPOINT_FILES) - {"speech_tokenizer"})
    unexpected += sorted({f"speech_tokenizer/{p.name}" for p in st_dir.iterdir()}
                         - {f"speech_tokenizer/{n}" for n in SPEECH_TOKENIZER_FILES})
    if unexpected:
        raise RuntimeError(f"{out_dir}: unexpected files {unexpected}")
    return ids



def write_reference_voice(path: Path) -> None:
    """The reference voice of the Base records as a 16-bit WAV: its samples are exactly
    reference_voice()'s (k / 32768), so reading it back gives what the records cloned."""
    import numpy as np
    import soundfile as sf
    samples = np.round(reference_voice() * 32768).astype(np.int16)
    sf.write(str(path), samples, 24000, subtype="PCM_16")


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=[t[0] for t in TARGETS], help="build/record one target only")
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="tokenizer training text")
    ap.add_argument("--frames", type=int, help=f"forced frames per prompt (default {FORCED_FRAMES}, "
                    f"Base and VoiceDesign {FORCED_FRAMES_VOICES})")
    ap.add_argument("--attn", default="eager", choices=["eager", "sdpa"], help="talker attention")
    ap.add_argument("--build", metavar="VARIANT", choices=sorted(VARIANTS),
                    help="only write a random checkpoint of this variant (e.g. 1.7b-real) into --ckpt, no records "
                         "(record them with `tts verify-golden --record`)")
    ap.add_argument("--ckpt", type=Path, help="with --build: the checkpoint folder")
    ap.add_argument("--kind", default="custom_voice", choices=["custom_voice", "base", "voice_design"],
                    help="with --build: the checkpoint's tts_model_type")
    a = ap.parse_args(argv)

    t0 = time.time()
    stubbed = stub_missing_audio_modules()
    print(f"stubbed audio modules: {stubbed}", flush=True)
    if a.build:
        if a.ckpt is None:
            ap.error("--build needs --ckpt DIR")
        build_checkpoint(a.ckpt, a.build, a.corpus, a.kind)
        print(f"{a.build} {a.kind}: {a.ckpt} ({_dir_size(a.ckpt) / 1e6:.1f} MB) in {time.time() - t0:.1f} s")
        return 0
    for name, variant, kind, ckpt_rel, golden_rel in TARGETS:
        if a.only and name != a.only:
            continue
        ckpt_dir, golden_dir = REPO_ROOT / ckpt_rel, REPO_ROOT / golden_rel
        ids = build_checkpoint(ckpt_dir, variant, a.corpus, kind)
        if kind == "base":
            write_reference_voice(REPO_ROOT / REFERENCE_VOICE_FILE)
        tensors, meta = record(ckpt_dir, frames=a.frames, attn_implementation=a.attn, weights_note=WEIGHTS_NOTE)
        write_golden(golden_dir, tensors, meta)
        print(f"\n== {name}: {ckpt_rel} ({_dir_size(ckpt_dir) / 1e6:.2f} MB), "
              f"{golden_rel} ({_dir_size(golden_dir) / 1e6:.2f} MB)")
        newline = ids["\n"]
        print(f"tokenizer: vocab {ids['vocab_size']}, assistant {ids['assistant']}, newline {newline}, "
              f"im_start {ids['<|im_start|>']}, tts_pad {ids['<tts_pad>']}")
        for row in meta["prompts"]:
            voice = row.get("clone") or row["speaker"]
            print(f"p{row['index']}: {voice}/{row['language']} instruct={row['instruct_effective']!r} "
                  f"non_streaming_mode={row.get('non_streaming_mode')} prefill {row['prefill_length']} "
                  f"forced {row['forced_frames']} natural {row['natural_frames']} "
                  f"(EOS {row['natural_stopped_by_eos']})")
        print("checks:", json.dumps(meta["checks"]))
    print(f"\ndone in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
