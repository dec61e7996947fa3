#!/usr/bin/env python
"""Golden fixtures recorded from the OFFICIAL Qwen3-TTS 12 Hz implementation (PyPI `qwen-tts-hf`).

Run (needs the reference environment: torch, transformers 5, qwen-tts-hf installed --no-deps):

    /work/refenv/bin/python tools/make_golden.py            # both checkpoints, ~30 s on 2 CPU cores

It writes, deterministically (a re-run rewrites identical bytes):

    tts_cli/assets/tiny-1.7b-customvoice/           tiny random CustomVoice checkpoint, tts_model_size "1b7"
    tests/fixtures/tiny-0.6b-customvoice/           tiny random CustomVoice checkpoint, tts_model_size "0b6"
    tts_cli/assets/golden/tiny-1.7b-customvoice/    records.safetensors + records.json
    tests/fixtures/golden/tiny-0.6b-customvoice/    records.safetensors + records.json

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
3. Records (`record`): the checkpoint is loaded through the official path
   `qwen_tts.Qwen3TTSModel.from_pretrained(dir, dtype=torch.float32, attn_implementation="eager")`
   on CPU, and `generate_custom_voice` runs greedy (do_sample=False, subtalker_dosample=False; the
   other settings, e.g. repetition_penalty 1.05, come from generation_config.json as in real use).
   Hooks on the talker record the exact prefill embeddings, the raw codec_head and code-predictor
   lm_head logits, the talker's final hidden states; the waveform is the wrapper's output. Each row
   runs alone with its length forced (EOS masked: min_new_tokens = max_new_tokens, as in
   shared/peer_bench/bench_ref.py), once unforced (the official min_new_tokens = 2), and all rows run
   together as one batch. The codec is also recorded on its own on random codes.

Tensor names in records.safetensors (i = prompt index, T = forced frames, H = talker width):
    p{i}.input_ids [n] int64            assistant-text ids from the official processor
    p{i}.instruct_ids [m] int64         only when the wrapper kept an instruct
    p{i}.prefill_embeds [L, H] fp32     talker input embeddings of the prefill (row alone)
    p{i}.step_embeds [T, H] fp32        talker input embedding of each decode step (16-way sum + tts_pad)
    p{i}.greedy_codes [T, 16] int64     forced-length greedy codes
    p{i}.talker_logits [T+1, 3072] fp32 raw codec_head logits: last prefill position, then every step
    p{i}.cp_logits [F, 15, 2048] fp32   raw code-predictor lm_head[j] logits, last position, for the
                                        first F = CP_LOGIT_FRAMES frames (every head and position;
                                        all T frames would make the records ~5x larger)
    p{i}.past_hidden [T+1, H] fp32      talker final-norm hidden state at those positions
    p{i}.wav [T*1920] fp32              official waveform of the forced run
    p{i}.greedy_codes_natural [N, 16]   unforced greedy run (official min_new_tokens = 2), up to
                                        NATURAL_MAX_NEW_TOKENS - 1 frames or the official EOS stop
    batch.greedy_codes.{i} [T, 16]      all prompts in one generate_custom_voice call, forced length
    codec.codes [90, 16] int64          random codes (fixed seed); 90 frames > the 72-frame window
    codec.wav [90*1920] fp32            official speech_tokenizer.decode of codec.codes
records.json holds the prompts, settings, special ids, versions, attention implementations,
self-checks (greedy argmax re-derived from the recorded logits, with the smallest top-1/top-2
margin) and the tensor shapes.

For live comparisons a test can import this file (`sys.path.insert(0, "tools"); import make_golden`;
it needs `qwen_tts` importable) and call
`build_checkpoint(dir, "1.7b")` and `record(dir) -> (tensors, meta)` without touching the files
written here. Importing it sets RAYON_NUM_THREADS=1, TOKENIZERS_PARALLELISM=false and
HF_HUB_OFFLINE=1 unless already set. The tokenizer corpus is ../shared/data/harvard-lists-01-36.txt
next to the repository (--corpus to override); recording needs no corpus.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import importlib.machinery
import json
import os
import sys
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

# Before tokenizers / transformers load: single-threaded BPE training (deterministic merges) and no
# network lookups from the Hub helpers.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = REPO_ROOT.parent / "shared" / "data" / "harvard-lists-01-36.txt"

# (variant, checkpoint dir, golden dir), relative to the repository root.
TARGETS = (
    ("1.7b", "tts_cli/assets/tiny-1.7b-customvoice", "tts_cli/assets/golden/tiny-1.7b-customvoice"),
    ("0.6b", "tests/fixtures/tiny-0.6b-customvoice", "tests/fixtures/golden/tiny-0.6b-customvoice"),
)

SAMPLES_PER_FRAME = 1920
FORCED_FRAMES = 20
CODEC_FRAMES = 90
WEIGHT_SEED = {"1.7b": 17, "0.6b": 6}
SPEECH_TOKENIZER_SEED = 1920
CODEC_CODES_SEED = 2048
RESIDUAL_OUT_GAIN = 0.2  # codec residual-unit output convs (see codec_output_gains)
FINAL_CONV_GAIN = 0.05   # codec final conv
WEIGHTS_NOTE = ("random, fixed seeds: >=2-D tensors N(0, 1/fan_in) (lookup tables N(0, 1)); codec residual-unit "
                "output convs x0.2 and final conv x0.05; norm weights 1+N(0, 0.1); biases N(0, 0.02); LayerScale "
                "scales, ConvNeXt gammas, SnakeBeta alpha/beta N(0, 0.1); cluster_usage U(0.5, 2). Main model "
                "stored bf16, speech tokenizer fp32.")


# ---------------------------------------------------------------------------------------------
# 1. Importing the official package on a machine without its audio dependencies
# ---------------------------------------------------------------------------------------------

# Imported at module level by qwen_tts but never called on the CustomVoice synthesis path.
AUDIO_MODULES = ("librosa", "librosa.filters", "soundfile", "sox", "torchaudio",
                 "torchaudio.compliance", "torchaudio.compliance.kaldi", "onnxruntime")


def _stub_module(name: str) -> types.ModuleType:
    """An importable placeholder whose every attribute is a function that raises when called."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__path__ = []

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def missing(*args, **kwargs):
            raise RuntimeError(f"{name}.{attr} is not available: {name} is stubbed by tools/make_golden.py")
        return missing
    module.__getattr__ = __getattr__
    return module


def stub_missing_audio_modules(names: tuple[str, ...] = AUDIO_MODULES) -> list[str]:
    """Register stubs for the audio packages that are not installed; returns the stubbed names.

    transformers probes (and caches) librosa/soundfile/torchaudio availability; the probes run
    first, so that they see the real environment and not a stub."""
    import transformers.audio_utils  # noqa: F401
    import transformers.processing_utils  # noqa: F401
    from transformers.utils import import_utils
    for probe in ("is_librosa_available", "is_soundfile_available", "is_torchaudio_available"):
        if hasattr(import_utils, probe):
            getattr(import_utils, probe)()
    stubbed = []
    for name in names:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
            continue
        except ImportError:
            pass
        sys.modules[name] = _stub_module(name)
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, sys.modules[name])
        stubbed.append(name)
    return stubbed


class _RopeThetaView:
    """A config seen through `rope_theta`, for configs that keep it only in rope_parameters."""

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name):
        if name == "rope_theta":
            return self._config.rope_parameters["rope_theta"]
        return getattr(self._config, name)


def patch_default_rope_init() -> None:
    """transformers-5.17 shim. qwen_tts registers its own "default" RoPE init function (it reads
    `config.rope_theta`), and transformers' PreTrainedModel._init_weights prefers the registry
    entry for every *RotaryEmbedding module, the speech tokenizer's Mimi encoder included, whose
    MimiConfig keeps theta only in `rope_parameters` -> AttributeError while building or loading
    the speech tokenizer. The wrapper falls back to rope_parameters["rope_theta"]."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    original = ROPE_INIT_FUNCTIONS["default"]
    if getattr(original, "_make_golden_shim", False):
        return

    def default_rope_init(config, *args, **kwargs):
        if not hasattr(config, "rope_theta") and isinstance(getattr(config, "rope_parameters", None), dict):
            config = _RopeThetaView(config)
        return original(config, *args, **kwargs)
    default_rope_init._make_golden_shim = True
    ROPE_INIT_FUNCTIONS["default"] = default_rope_init


def import_official() -> types.ModuleType:
    """`import qwen_tts` with the audio stubs and the RoPE shim in place."""
    stub_missing_audio_modules()
    qwen_tts = importlib.import_module("qwen_tts")
    patch_default_rope_init()
    return qwen_tts


# ---------------------------------------------------------------------------------------------
# 2. Tiny Qwen2-compatible text tokenizer
# ---------------------------------------------------------------------------------------------

# Added tokens of the Qwen2.5/Qwen3 vocabulary in id order (the real ones start at 151643), with
# the "special" flag of the published tokenizer_config.json.
QWEN_SPECIAL_TOKENS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
    ("<|audio_start|>", True), ("<|audio_end|>", True), ("<tts_pad>", True), ("<tts_text_bos>", True),
    ("<tts_text_eod>", True), ("<tts_text_bos_single>", True), ("<|audio_pad|>", True),
)
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
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(BPE_VOCAB_SIZE))

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


def assistant_text(text: str) -> str:
    """The official wrapper's template for the text to speak (Qwen3TTSModel._build_assistant_text)."""
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def instruct_text(instruct: str) -> str:
    """The official wrapper's template for an instruct (Qwen3TTSModel._build_instruct_text)."""
    return f"<|im_start|>user\n{instruct}<|im_end|>\n"


def check_template_ids(ids: list[int], special: dict[str, int], text: str = "") -> None:
    """The official prompt builder slices input_ids[:, :3] as the role and [:, 3:-5] as the text:
    the template must give exactly [im_start, assistant, \\n] + text + [im_end, \\n, im_start, assistant, \\n]."""
    head = [special["<|im_start|>"], special["assistant"], special["\n"]]
    tail = [special["<|im_end|>"], special["\n"], special["<|im_start|>"], special["assistant"], special["\n"]]
    if ids[:3] != head or ids[-5:] != tail or len(ids) < 9:
        raise AssertionError(f"template tokenization broken for {text!r}: {ids}")
    if any(i >= special["bpe_vocab_size"] for i in ids[3:-5]):
        raise AssertionError(f"special token inside the text ids for {text!r}: {ids}")


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


VARIANTS = {
    "1.7b": Variant(tts_model_size="1b7", talker_hidden=32),  # small_to_mtp_projection 32 -> 16
    "0.6b": Variant(tts_model_size="0b6", talker_hidden=16),  # talker width == CP width: identity
}


def model_config(variant: str, ids: dict[str, int]) -> dict:
    """config.json of a tiny CustomVoice checkpoint (structure and tables of the real file)."""
    v = VARIANTS[variant]
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
        codec_language_id=dict(CODEC_LANGUAGE_ID), spk_id=dict(SPK_ID), spk_is_dialect=dict(SPK_IS_DIALECT),
        code_predictor_config=code_predictor)
    return dict(
        architectures=["Qwen3TTSForConditionalGeneration"], model_type="qwen3_tts",
        tts_model_type="custom_voice", tts_model_size=v.tts_model_size, tokenizer_type="qwen3_tts_tokenizer_12hz",
        im_start_token_id=ids["<|im_start|>"], im_end_token_id=ids["<|im_end|>"],
        assistant_token_id=ids["assistant"], tts_pad_token_id=ids["<tts_pad>"],
        tts_bos_token_id=ids["<tts_text_bos>"], tts_eos_token_id=ids["<tts_text_eod>"],
        talker_config=talker, torch_dtype="bfloat16")


def speech_tokenizer_config() -> dict:
    """speech_tokenizer/config.json: the real decoder structure at tiny widths, and a Mimi encoder
    (never used for synthesis, but built by the official loader) at the smallest practical size."""
    decoder = dict(
        codebook_size=2048, codebook_dim=16, num_quantizers=16, num_semantic_quantizers=1,
        semantic_codebook_size=4096, latent_dim=32, decoder_dim=32, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=8, hidden_act="silu",
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


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


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


def build_checkpoint(out_dir: str | Path, variant: str, corpus: str | Path = DEFAULT_CORPUS) -> dict[str, int]:
    """Write a tiny random CustomVoice checkpoint ("1.7b" or "0.6b") into out_dir, in the official
    layout; returns the tokenizer ids (see build_tokenizer)."""
    import_official()
    from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = build_tokenizer(out_dir, corpus)

    cfg = model_config(variant, ids)
    torch.manual_seed(0)  # construction-time init; every parameter is redrawn below anyway
    model = Qwen3TTSForConditionalGeneration(Qwen3TTSConfig(**{k: v for k, v in cfg.items() if k != "model_type"}))
    randomize_(model, WEIGHT_SEED[variant])
    _write_json(out_dir / "config.json", dict(cfg, transformers_version=CONFIG_TRANSFORMERS_VERSION))
    _save_weights(model, out_dir / "model.safetensors", torch.bfloat16)
    _write_json(out_dir / "generation_config.json", GENERATION_CONFIG)
    _write_json(out_dir / "preprocessor_config.json", PREPROCESSOR_CONFIG)

    st_dir = out_dir / "speech_tokenizer"
    st_dir.mkdir(exist_ok=True)
    st_cfg = speech_tokenizer_config()
    torch.manual_seed(0)
    codec = Qwen3TTSTokenizerV2Model(
        Qwen3TTSTokenizerV2Config(**{k: v for k, v in st_cfg.items() if k != "model_type"}))
    randomize_(codec, SPEECH_TOKENIZER_SEED, codec_output_gains(codec))
    _write_json(st_dir / "config.json", dict(st_cfg, transformers_version=CONFIG_TRANSFORMERS_VERSION))
    _save_weights(codec, st_dir / "model.safetensors", torch.float32)
    _write_json(st_dir / "preprocessor_config.json", SPEECH_PREPROCESSOR_CONFIG)

    unexpected = sorted({p.name for p in out_dir.iterdir()} - set(CHECKPOINT_FILES) - {"speech_tokenizer"})
    unexpected += sorted({f"speech_tokenizer/{p.name}" for p in st_dir.iterdir()}
                         - {f"speech_tokenizer/{n}" for n in SPEECH_TOKENIZER_FILES})
    if unexpected:
        raise RuntimeError(f"{out_dir}: unexpected files {unexpected}")
    return ids


# ---------------------------------------------------------------------------------------------
# 4. Recording the official implementation
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prompt:
    text: str
    speaker: str
    language: str
    instruct: str | None = None


PROMPTS = {
    "1b7": (
        Prompt("The birch canoe slid on the smooth planks.", "vivian", "english"),
        # dylan is a Beijing-dialect speaker: language chinese is overridden to beijing_dialect
        Prompt("今天天气很好，我们去公园散步吧。Let's go!", "dylan", "chinese"),
        # language auto -> no language tag (the "nothink" codec prefix), with an instruct
        Prompt("Glue the sheet to the dark blue background.", "ryan", "auto", "Speak slowly and calmly."),
    ),
    "0b6": (
        # the official wrapper drops every instruct for tts_model_size "0b6"
        Prompt("It's easy to tell the depth of a well.", "aiden", "english", "Read this with a cheerful, energetic voice."),
        # eric is a Sichuan-dialect speaker: language auto is overridden to sichuan_dialect
        Prompt("These days a chicken leg is a rare dish.", "eric", "auto"),
    ),
}


def load_official(ckpt_dir: str | Path, attn_implementation: str = "eager"):
    """The official wrapper, loaded through its normal path on CPU in fp32."""
    qwen_tts = import_official()
    return qwen_tts.Qwen3TTSModel.from_pretrained(str(ckpt_dir), dtype=torch.float32,
                                                  attn_implementation=attn_implementation)


def check_loaded_weights(tts, ckpt_dir: str | Path) -> None:
    """Every tensor the official loader ended up with equals the file's (no re-init, no tying)."""
    from safetensors.torch import load_file
    ckpt_dir = Path(ckpt_dir)
    for module, path in ((tts.model, ckpt_dir / "model.safetensors"),
                         (tts.model.speech_tokenizer.model, ckpt_dir / "speech_tokenizer" / "model.safetensors")):
        saved = load_file(str(path))
        loaded = module.state_dict()
        if set(saved) != set(loaded):
            raise AssertionError(f"{path}: key mismatch, file-only {sorted(set(saved) - set(loaded))[:5]}, "
                                 f"model-only {sorted(set(loaded) - set(saved))[:5]}")
        bad = [k for k in saved if not torch.equal(saved[k].float(), loaded[k].float())]
        if bad:
            raise AssertionError(f"{path}: the official loader changed {len(bad)} tensors, e.g. {bad[:5]}")


class TalkerTrace:
    """Hooks on the official talker while one generate call runs (batch of one row)."""

    def __init__(self, talker):
        self.talker = talker
        self.inputs: list[torch.Tensor] = []       # talker.model inputs_embeds per forward [1, S, H]
        self.hidden: list[torch.Tensor] = []       # talker.model last_hidden_state[:, -1]
        self.logits: list[torch.Tensor] = []       # codec_head output [:, -1]
        self.cp_logits: list[list[torch.Tensor]] = [[] for _ in talker.code_predictor.lm_head]
        self._handles = []

    def __enter__(self) -> "TalkerTrace":
        def before_model(module, args, kwargs):
            self.inputs.append(kwargs["inputs_embeds"].detach().clone())

        def after_model(module, args, kwargs, output):
            self.hidden.append(output.last_hidden_state[:, -1].detach().clone())

        def after_head(module, args, output):
            self.logits.append(output[:, -1].detach().float().clone())

        t = self.talker
        self._handles = [t.model.register_forward_pre_hook(before_model, with_kwargs=True),
                         t.model.register_forward_hook(after_model, with_kwargs=True),
                         t.codec_head.register_forward_hook(after_head)]
        for j, head in enumerate(t.code_predictor.lm_head):
            def after_cp_head(module, args, output, j=j):
                self.cp_logits[j].append(output[:, -1].detach().float().clone())
            self._handles.append(head.register_forward_hook(after_cp_head))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def tensors(self, frames: int) -> dict[str, torch.Tensor]:
        """Per-row tensors; checks that the call made T+1 talker and T code-predictor passes."""
        if len(self.inputs) != frames + 1 or len(self.logits) != frames + 1:
            raise AssertionError(f"expected {frames + 1} talker forwards, saw {len(self.inputs)}")
        if any(len(c) != frames for c in self.cp_logits):
            raise AssertionError(f"expected {frames} code-predictor frames, saw {[len(c) for c in self.cp_logits]}")
        return {
            "prefill_embeds": self.inputs[0][0].float(),
            "step_embeds": torch.cat([x[0] for x in self.inputs[1:]]).float(),
            "talker_logits": torch.cat(self.logits),
            "cp_logits": torch.stack([torch.cat(c) for c in self.cp_logits], dim=1),
            "past_hidden": torch.cat(self.hidden).float(),
        }


@contextlib.contextmanager
def forced_length(enabled: bool = True) -> Iterator[None]:
    """Make every talker generate run to max_new_tokens (EOS masked throughout), like
    shared/peer_bench/bench_ref.py: the official generate hard-codes min_new_tokens=2."""
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSTalkerForConditionalGeneration as Talker
    original = Talker.generate
    if not enabled:
        yield
        return

    def generate(self, *args, **kwargs):
        if "max_new_tokens" in kwargs:
            kwargs["min_new_tokens"] = kwargs["max_new_tokens"]
        return original(self, *args, **kwargs)
    Talker.generate = generate
    try:
        yield
    finally:
        Talker.generate = original


@contextlib.contextmanager
def captured_generate(tts) -> Iterator[dict]:
    """Record the arguments and the per-row codes of Qwen3TTSForConditionalGeneration.generate
    (generate_custom_voice returns only waveforms)."""
    model = tts.model
    original = model.generate
    seen: dict[str, Any] = {}

    def generate(*args, **kwargs):
        seen["kwargs"] = kwargs
        codes, hidden = original(*args, **kwargs)
        seen["codes"] = [c.detach().clone() for c in codes]
        return codes, hidden
    model.generate = generate
    try:
        yield seen
    finally:
        del model.generate  # back to the class method


def _processed_talker_scores(logits: torch.Tensor, previous: list[int], step: int, min_new_tokens: int,
                             eos: int, penalty: float) -> torch.Tensor:
    """The talker's logits processors (HF order) for a greedy step: repetition penalty over the
    previously generated codebook-0 ids, EOS masked before min_new_tokens, ids 2048..3071 but EOS
    suppressed."""
    scores = logits.clone()
    if previous:
        prev = torch.tensor(sorted(set(previous)))
        picked = scores[prev]
        scores[prev] = torch.where(picked < 0, picked * penalty, picked / penalty)
    if step < min_new_tokens:
        scores[eos] = float("-inf")
    suppressed = torch.arange(scores.shape[-1] - 1024, scores.shape[-1])
    suppressed = suppressed[suppressed != eos]
    scores[suppressed] = float("-inf")
    return scores


def _margin(scores: torch.Tensor) -> float:
    top = torch.topk(scores, 2).values
    return float(top[0] - top[1])


def check_greedy(tensors: dict[str, torch.Tensor], codes: torch.Tensor, min_new_tokens: int, eos: int,
                 penalty: float) -> dict[str, float]:
    """Re-derive every greedy choice from the recorded raw logits; return the smallest margins."""
    talker_margin, cp_margin = float("inf"), float("inf")
    firsts = codes[:, 0].tolist()
    for k, first in enumerate(firsts):
        scores = _processed_talker_scores(tensors["talker_logits"][k], firsts[:k], k, min_new_tokens, eos, penalty)
        if int(scores.argmax()) != first:
            raise AssertionError(f"talker step {k}: argmax {int(scores.argmax())} != recorded code {first}")
        talker_margin = min(talker_margin, _margin(scores))
        for j in range(15):
            cp = tensors["cp_logits"][k, j]
            if int(cp.argmax()) != int(codes[k, j + 1]):
                raise AssertionError(f"frame {k} group {j + 1}: argmax {int(cp.argmax())} != {int(codes[k, j + 1])}")
            cp_margin = min(cp_margin, _margin(cp))
    return {"talker_min_margin": talker_margin, "cp_min_margin": cp_margin}


def _tokenizer_agreement(tts, ckpt_dir: Path, texts: list[str], official_ids: list[list[int]]) -> dict:
    """Does plain AutoTokenizer.from_pretrained(dir) (no fix_mistral_regex) give the official ids?"""
    from transformers import AutoTokenizer
    plain = AutoTokenizer.from_pretrained(str(ckpt_dir))
    same = [plain(t)["input_ids"] == ids for t, ids in zip(texts, official_ids)]
    return {"auto_tokenizer_class": type(plain).__name__,
            "official_tokenizer_class": type(tts.processor.tokenizer).__name__,
            "auto_tokenizer_same_ids": all(same),
            "official_fix_mistral_regex_attr": getattr(tts.processor.tokenizer, "fix_mistral_regex", None)}


def _versions() -> dict[str, str]:
    import importlib.metadata as md
    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    for dist in ("transformers", "qwen-tts-hf", "tokenizers", "safetensors", "accelerate"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


CP_LOGIT_FRAMES = 4
# The unforced run may go this far, so that a row that draws EOS shows where the official rule stops it.
NATURAL_MAX_NEW_TOKENS = 161


def record(ckpt_dir: str | Path, prompts: tuple[Prompt, ...] | None = None, frames: int = FORCED_FRAMES,
           attn_implementation: str = "eager") -> tuple[dict[str, torch.Tensor], dict]:
    """Run the official implementation on ckpt_dir and return (tensors, meta) as described in the
    module docstring. prompts default to PROMPTS[config tts_model_size]."""
    ckpt_dir = Path(ckpt_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one fixed reduction order
    try:
        return _record(ckpt_dir, prompts, frames, attn_implementation)
    finally:
        torch.set_num_threads(threads)


def _record(ckpt_dir: Path, prompts, frames: int, attn: str) -> tuple[dict[str, torch.Tensor], dict]:
    tts = load_official(ckpt_dir, attn)
    check_loaded_weights(tts, ckpt_dir)
    model, cfg = tts.model, tts.model.config
    talker_cfg = cfg.talker_config
    prompts = tuple(prompts or PROMPTS[cfg.tts_model_size])
    tokenizer = tts.processor.tokenizer
    special = {t: tokenizer.convert_tokens_to_ids(t) for t, _ in QWEN_SPECIAL_TOKENS}
    special.update(assistant=tokenizer.convert_tokens_to_ids("assistant"), newline=tokenizer.convert_tokens_to_ids("Ċ"))
    template_ids = dict(special, **{"\n": special["newline"], "bpe_vocab_size": special["<|endoftext|>"]})

    settings = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=frames + 1)
    eos, penalty = talker_cfg.codec_eos_token_id, tts._merge_generate_kwargs(**settings)["repetition_penalty"]
    tensors: dict[str, torch.Tensor] = {}
    rows, checks = [], {"talker_min_margin": float("inf"), "cp_min_margin": float("inf")}

    for i, p in enumerate(prompts):
        call = dict(text=p.text, speaker=p.speaker, language=p.language, instruct=p.instruct)
        with captured_generate(tts) as gen, TalkerTrace(model.talker) as trace, forced_length():
            wavs, sr = tts.generate_custom_voice(**call, **settings)
        codes = gen["codes"][0].cpu()
        if codes.shape != (frames, 16) or len(wavs[0]) != frames * SAMPLES_PER_FRAME or sr != 24000:
            raise AssertionError(f"prompt {i}: codes {tuple(codes.shape)}, wav {len(wavs[0])}, sr {sr}")
        input_ids = gen["kwargs"]["input_ids"][0][0].cpu()
        check_template_ids(input_ids.tolist(), template_ids, p.text)
        instruct_ids = gen["kwargs"]["instruct_ids"][0]
        generate_kwargs = _jsonable(gen["kwargs"], skip=("input_ids", "instruct_ids", "languages", "speakers"))
        tensors[f"p{i}.input_ids"] = input_ids
        if instruct_ids is not None:
            tensors[f"p{i}.instruct_ids"] = instruct_ids[0].cpu()
        traced = trace.tensors(frames)
        for k, v in traced.items():
            tensors[f"p{i}.{k}"] = v[:CP_LOGIT_FRAMES] if k == "cp_logits" else v
        tensors[f"p{i}.greedy_codes"] = codes
        tensors[f"p{i}.wav"] = torch.from_numpy(wavs[0]).float()
        margins = check_greedy(traced, codes, frames + 1, eos, penalty)
        checks = {k: min(checks[k], margins[k]) for k in checks}

        with captured_generate(tts) as natural:
            tts.generate_custom_voice(**call, **dict(settings, max_new_tokens=NATURAL_MAX_NEW_TOKENS))
        natural_codes = natural["codes"][0].cpu()
        tensors[f"p{i}.greedy_codes_natural"] = natural_codes
        n = natural_codes.shape[0]

        language = p.language.lower()
        language_id = None if language == "auto" else talker_cfg.codec_language_id[language]
        dialect = talker_cfg.spk_is_dialect[p.speaker]
        if language in ("chinese", "auto") and dialect:
            language_id = talker_cfg.codec_language_id[dialect]
        rows.append(dict(
            index=i, **asdict(p),
            instruct_effective=(p.instruct if instruct_ids is not None else None),
            speaker_codec_id=talker_cfg.spk_id[p.speaker], language_codec_id=language_id,
            prefill_length=int(traced["prefill_embeds"].shape[0]), input_ids_length=int(input_ids.shape[0]),
            forced_frames=frames, max_new_tokens=frames + 1, min_new_tokens=frames + 1,
            natural_frames=n, natural_min_new_tokens=2, natural_max_new_tokens=NATURAL_MAX_NEW_TOKENS,
            natural_stopped_by_eos=n < NATURAL_MAX_NEW_TOKENS - 1,
            natural_equals_forced_prefix=bool(torch.equal(natural_codes[:frames], codes[:n])),
        ))

    # All rows in one call (left-padded lockstep batch), same forced length.
    batch_call = dict(text=[p.text for p in prompts], speaker=[p.speaker for p in prompts],
                      language=[p.language for p in prompts], instruct=[p.instruct for p in prompts])
    with captured_generate(tts) as gen, forced_length():
        tts.generate_custom_voice(**batch_call, **settings)
    batch_equal = []
    for i, codes in enumerate(gen["codes"]):
        tensors[f"batch.greedy_codes.{i}"] = codes.cpu()
        batch_equal.append(bool(torch.equal(codes.cpu(), tensors[f"p{i}.greedy_codes"])))

    # The codec alone on random codes.
    codes = torch.randint(0, 2048, (CODEC_FRAMES, 16), generator=torch.Generator().manual_seed(CODEC_CODES_SEED))
    wavs, _ = model.speech_tokenizer.decode([{"audio_codes": codes}])
    tensors["codec.codes"] = codes
    tensors["codec.wav"] = torch.from_numpy(wavs[0]).float()

    texts = [assistant_text(p.text) for p in prompts]
    checks.update(_tokenizer_agreement(tts, ckpt_dir, texts, [tensors[f"p{i}.input_ids"].tolist()
                                                               for i in range(len(prompts))]))
    checks["batch_codes_equal_single"] = batch_equal
    for key in [f"p{i}.wav" for i in range(len(prompts))] + ["codec.wav"]:
        wav = tensors[key]
        checks[f"{key}.rms"] = float(wav.pow(2).mean().sqrt())
        checks[f"{key}.clipped_fraction"] = float((wav.abs() >= 1).float().mean())

    codec_cfg = model.speech_tokenizer.model.config
    meta = dict(
        source="official qwen_tts (qwen-tts-hf) via tools/make_golden.py",
        checkpoint=_display_path(ckpt_dir),
        tts_model_size=cfg.tts_model_size,
        load=dict(call="qwen_tts.Qwen3TTSModel.from_pretrained(dir, dtype=torch.float32, "
                       f"attn_implementation={attn!r})", device="cpu", dtype="float32"),
        attn_implementation=dict(talker=talker_cfg._attn_implementation,
                                 code_predictor=talker_cfg.code_predictor_config._attn_implementation,
                                 codec=codec_cfg.decoder_config._attn_implementation),
        generation=dict(
            call="generate_custom_voice(text, speaker, language, instruct, do_sample=False, "
                 "subtalker_dosample=False, max_new_tokens=F+1); the rest from generation_config.json",
            generate_kwargs=generate_kwargs,
            forced="Qwen3TTSTalkerForConditionalGeneration.generate wrapped: min_new_tokens = max_new_tokens",
            forced_frames=frames, max_new_tokens=frames + 1, min_new_tokens=frames + 1,
            natural_min_new_tokens=2, codec_eos_token_id=eos, repetition_penalty=penalty,
            suppressed_talker_ids="2048..3071 except codec_eos_token_id"),
        tokenizer=dict(vocab_size=len(tokenizer), bpe_vocab_size=special["<|endoftext|>"],
                       text_vocab_size=talker_cfg.text_vocab_size, special_ids=special),
        weights=WEIGHTS_NOTE,
        prompts=rows,
        batch=dict(rows=len(prompts), forced_frames=frames, codes_equal_single=batch_equal),
        codec=dict(frames=CODEC_FRAMES, seed=CODEC_CODES_SEED, call="model.speech_tokenizer.decode([{'audio_codes': codes}])"),
        checks=checks,
        versions=_versions(),
        tensors={k: dict(shape=list(v.shape), dtype=str(v.dtype).replace("torch.", "")) for k, v in tensors.items()},
    )
    return tensors, meta


def _display_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _jsonable(kwargs: dict, skip: tuple[str, ...]) -> dict:
    return {k: v for k, v in kwargs.items() if k not in skip and isinstance(v, (bool, int, float, str, list, type(None)))}


def write_golden(golden_dir: str | Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """records.safetensors + records.json. The date is the first time this exact content was
    written: a re-run that reproduces the content keeps the old date (identical files)."""
    from safetensors.torch import save_file
    golden_dir = Path(golden_dir)
    golden_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(golden_dir / "records.safetensors"))
    meta_path = golden_dir / "records.json"
    date = datetime.date.today().isoformat()
    if meta_path.is_file():
        old = json.loads(meta_path.read_text(encoding="utf-8"))
        if {k: v for k, v in old.items() if k != "date"} == json.loads(json.dumps(meta)):
            date = old.get("date", date)
    _write_json(meta_path, dict(meta, date=date))


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=[t[0] for t in TARGETS], help="build/record one variant only")
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="tokenizer training text")
    ap.add_argument("--frames", type=int, default=FORCED_FRAMES, help="forced frames per prompt")
    ap.add_argument("--attn", default="eager", choices=["eager", "sdpa"], help="talker attention")
    a = ap.parse_args(argv)

    t0 = time.time()
    stubbed = stub_missing_audio_modules()
    print(f"stubbed audio modules: {stubbed}", flush=True)
    for variant, ckpt_rel, golden_rel in TARGETS:
        if a.only and variant != a.only:
            continue
        ckpt_dir, golden_dir = REPO_ROOT / ckpt_rel, REPO_ROOT / golden_rel
        ids = build_checkpoint(ckpt_dir, variant, a.corpus)
        tensors, meta = record(ckpt_dir, frames=a.frames, attn_implementation=a.attn)
        write_golden(golden_dir, tensors, meta)
        print(f"\n== {variant}: {ckpt_rel} ({_dir_size(ckpt_dir) / 1e6:.2f} MB), "
              f"{golden_rel} ({_dir_size(golden_dir) / 1e6:.2f} MB)")
        newline = ids["\n"]
        print(f"tokenizer: vocab {ids['vocab_size']}, assistant {ids['assistant']}, newline {newline}, "
              f"im_start {ids['<|im_start|>']}, tts_pad {ids['<tts_pad>']}")
        for row in meta["prompts"]:
            print(f"p{row['index']}: {row['speaker']}/{row['language']} instruct={row['instruct_effective']!r} "
                  f"prefill {row['prefill_length']} forced {row['forced_frames']} natural {row['natural_frames']}")
        print("checks:", json.dumps(meta["checks"]))
    print(f"\ndone in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
