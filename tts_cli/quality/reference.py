"""Golden records from the OFFICIAL Qwen3-TTS 12 Hz implementation (PyPI `qwen-tts-hf`, the
optional extra `[reference]`): `record(checkpoint dir) -> (tensors, meta)` and `write_golden`.

Used by tools/make_golden.py (the tiny fixtures), by `tts verify-golden --record` (any checkpoint)
and by the live parity test. `import_official()` imports `qwen_tts` with stubs for the audio
packages it imports but never uses on the CustomVoice path, and a RoPE-init fix for transformers 5.17.

Records (`record`): the checkpoint is loaded through the official path
`qwen_tts.Qwen3TTSModel.from_pretrained(dir, dtype=torch.float32, attn_implementation="eager")`
on CPU (or, for checkpoints too large for that, on a CUDA device with TF32 off: still fp32, other
reduction orders), and the method of the checkpoint's kind runs greedy (do_sample=False,
subtalker_dosample=False; the other settings, e.g. repetition_penalty 1.05, come from
generation_config.json as in real use): `generate_custom_voice`, `generate_voice_design`, or for
Base `generate_voice_clone` with the prompts of `create_voice_clone_prompt` on reference_voice()
(ICL with REFERENCE_TEXT, and x-vector only). Each prompt runs in its text mode
(`non_streaming_mode`: its own or the method's default).
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
Base and VoiceDesign records differ: cp_logits of the first frame only; no codec.* (each prompt's
waveform checks the codec); a batch per text mode, every row in that mode,
    batch.non_streaming_{true,false}.greedy_codes.{i} [T, 16]
and for Base the official reference encodings and ICL transcripts:
    ref.speaker_embedding [D] fp32      the official x-vector of reference_voice()
    ref.codes [R, 16] int64             its official 12 Hz codes (R = 31)
    p{i}.ref_ids [m] int64              ICL prompts: the tokenized reference transcript
    p{i}.wav                            ICL prompts: decoded after ref.codes and cut (the official way)
records.json holds the prompts, settings, special ids, versions, attention implementations,
self-checks (greedy argmax re-derived from the recorded logits, with the smallest top-1/top-2
margin) and the tensor shapes.
"""
from __future__ import annotations

import contextlib
import datetime
import importlib
import importlib.machinery
import json
import sys
import types
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]  # of a checkout; paths outside it are shown whole
SAMPLES_PER_FRAME = 1920
FORCED_FRAMES = 20
# Base and VoiceDesign records: fewer forced frames and a shorter unforced run (their tests run
# more kinds of prompt); still past the end of the tiny prompts' trailing text, and the tiny Base
# checkpoints' rows end by EOS within 40 frames (tools/make_golden.py BASE_EOS_LOGIT_GAIN).
FORCED_FRAMES_VOICES = 12
CODEC_FRAMES = 90
CODEC_CODES_SEED = 2048

# ---------------------------------------------------------------------------------------------
# 1. Importing the official package on a machine without its audio dependencies
# ---------------------------------------------------------------------------------------------

# Imported at module level by qwen_tts but never called on the CustomVoice synthesis path (Base's
# speaker encoder calls librosa.filters.mel: stubbed with ours, below).
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
            raise RuntimeError(f"{name}.{attr} is not available: {name} is stubbed by tts_cli.quality.reference")
        return missing
    module.__getattr__ = __getattr__
    return module


def stub_missing_audio_modules(names: tuple[str, ...] = AUDIO_MODULES) -> list[str]:
    """Register stubs for the audio packages that are not installed; returns the stubbed names.

    transformers probes (and caches) librosa/soundfile/torchaudio availability; the probes run
    first, so that they see the real environment and not a stub."""
    for module in ("transformers.audio_utils", "transformers.processing_utils"):
        importlib.import_module(module)
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
    if "librosa.filters" in stubbed:
        # The speaker encoder's front end (Base checkpoints) needs librosa's mel filterbank: ours,
        # equal to librosa's to 1e-9 (tests/test_encoders.py against a librosa recording).
        sys.modules["librosa.filters"].mel = _slaney_mel
    return stubbed


def _slaney_mel(sr: int, n_fft: int, n_mels: int = 128, fmin: float = 0.0, fmax: float | None = None):
    """librosa.filters.mel with its defaults (Slaney scale and area), as a float32 numpy array."""
    from tts_cli.model.speaker_encoder import slaney_mel_filterbank
    return slaney_mel_filterbank(sr, n_fft, n_mels, fmin, sr / 2 if fmax is None else fmax).numpy()


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


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")



# ---------------------------------------------------------------------------------------------
# 4. Recording the official implementation
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prompt:
    text: str
    speaker: str | None          # CustomVoice only
    language: str
    instruct: str | None = None
    clone: str | None = None     # Base: "icl" or "x_vector" (the reference voice, REFERENCE_TEXT its transcript)
    non_streaming_mode: bool | None = None   # None: the official method's default

    def fields(self) -> dict:
        """The prompt as a record row: the Base/VoiceDesign fields only where set."""
        row = asdict(self)
        for key in ("clone", "non_streaming_mode"):
            if row[key] is None:
                del row[key]
        return row


# What the Base records clone: REFERENCE_VOICE_SECONDS of reference_voice(), which the 12 Hz
# encoder turns into 31 frames; with the 12 forced frames the official ICL cut lands one sample
# before the reference's end (31 of 43 frames), which the records keep.
REFERENCE_TEXT = "The box was thrown beside the parked truck."
REFERENCE_VOICE_SECONDS = 2.45
REFERENCE_VOICE_SEED = 245
REFERENCE_SAMPLE_RATE = 24000

# Base: ICL and x-vector only, each in both text modes; the streaming ICL prompts cover both of
# the official branches (a text track longer than the codec track continues as trailing text; a
# shorter one is padded with tts_pad). VoiceDesign: an instruct in both modes, and none. Every
# streaming prompt's trailing text ends within the forced frames (8, 9 and 9 steps), so that the
# teacher-forced logits cover the steps after it too.
LONG_TEXT = "The birch canoe slid on the smooth planks. The grass curled around the fence post."
CLONE_PROMPTS = (
    Prompt("Rice is often served in round bowls.", None, "english", clone="icl"),
    Prompt(LONG_TEXT, None, "auto", clone="icl"),
    Prompt("The juice of lemons makes fine punch.", None, "english", clone="icl", non_streaming_mode=True),
    Prompt("Two blue fish swam in the tank.", None, "english", clone="x_vector"),
    Prompt("今天天气很好，我们去公园散步吧。", None, "chinese", clone="x_vector", non_streaming_mode=True),
)
PROMPTS_BY_KIND = {
    "base": {"1b7": CLONE_PROMPTS, "0b6": CLONE_PROMPTS[1:]},
    "voice_design": {"1b7": (
        Prompt("The birch canoe slid on the smooth planks.", None, "english", "A deep, calm male voice."),
        Prompt("The salt breeze came across from the sea.", None, "auto", "Read this with a cheerful, energetic "
               "voice.", non_streaming_mode=False),
        Prompt("北京的秋天是一年中最美的季节。", None, "chinese", ""),
    )},
}

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


def load_official(ckpt_dir: str | Path, attn_implementation: str = "eager", device: str = "cpu"):
    """The official wrapper, loaded through its normal path in fp32 (on CPU, or on `device`)."""
    qwen_tts = import_official()
    placement = {} if device == "cpu" else {"device_map": device}
    return qwen_tts.Qwen3TTSModel.from_pretrained(str(ckpt_dir), dtype=torch.float32,
                                                  attn_implementation=attn_implementation, **placement)


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
        bad = [k for k in saved if not torch.equal(saved[k].float(), loaded[k].float().cpu())]
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
NATURAL_MAX_NEW_TOKENS_VOICES = 41   # Base and VoiceDesign (FORCED_FRAMES_VOICES)


def record(ckpt_dir: str | Path, prompts: tuple[Prompt, ...] | None = None, frames: int | None = None,
           attn_implementation: str = "eager",
           weights_note: str = "as stored in the checkpoint", device: str = "cpu",
           natural_max_new_tokens: int | None = None,
           prompt_count: int | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Run the official implementation on ckpt_dir and return (tensors, meta) as described in the
    module docstring. prompts default to those of the checkpoint's kind and size (PROMPTS,
    PROMPTS_BY_KIND), their first prompt_count when given. device: "cpu" (the fixtures), or a CUDA
    device for checkpoints at real sizes (fp32 with TF32 off; the flags are restored afterwards).
    frames: forced frames per prompt (default FORCED_FRAMES, for Base and VoiceDesign
    FORCED_FRAMES_VOICES). natural_max_new_tokens caps the unforced run (frames + 1: no longer
    than the forced one; default NATURAL_MAX_NEW_TOKENS, for Base and VoiceDesign
    NATURAL_MAX_NEW_TOKENS_VOICES)."""
    ckpt_dir = Path(ckpt_dir)
    threads = torch.get_num_threads()
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.set_num_threads(1)  # one fixed reduction order
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False   # fp32 on CUDA too
    try:
        return _record(ckpt_dir, prompts, frames, attn_implementation, weights_note, device,
                       natural_max_new_tokens, prompt_count)
    finally:
        torch.set_num_threads(threads)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def reference_voice() -> np.ndarray:
    """The seeded reference voice of the Base records: REFERENCE_VOICE_SECONDS at 24 kHz, float32
    on the 16-bit grid (k / 32768, so a 16-bit WAV of it reads back exactly). Speech-like enough
    to give the encoders some work: a voiced source with a gliding pitch, three formant-like
    resonances, syllable-rate loudness and a little noise."""
    rng = np.random.default_rng(REFERENCE_VOICE_SEED)
    t = np.arange(round(REFERENCE_VOICE_SECONDS * REFERENCE_SAMPLE_RATE)) / REFERENCE_SAMPLE_RATE
    pitch = 125 + 35 * np.sin(2 * np.pi * 0.8 * t + rng.uniform(0, 2 * np.pi))
    phase = 2 * np.pi * np.cumsum(pitch) / REFERENCE_SAMPLE_RATE
    formants = rng.uniform([450, 1300, 2300], [650, 1700, 2900])
    voice = np.zeros_like(t)
    for k in range(1, 31):
        gain = sum(np.exp(-0.5 * ((k * pitch - f) / 180) ** 2) for f in formants) + 0.02
        voice += gain * np.sin(k * phase) / k ** 0.5
    syllables = 0.5 * (1 - np.cos(2 * np.pi * 3.7 * t)) ** 2
    signal = voice * syllables + 0.01 * rng.standard_normal(t.shape)
    signal *= 0.6 / np.abs(signal).max()
    from tts_cli.output.writer import pcm16
    return (pcm16(signal) / 32768).astype(np.float32)


def _official_generate(tts, prompts: list[Prompt], settings: dict, voices: dict,
                       non_streaming_mode: bool | None = None):
    """One call of the official method of the checkpoint's kind on `prompts` (a batch when
    several), in their text mode or `non_streaming_mode` (one per call in the official API)."""
    kind = tts.model.tts_model_type
    modes = {non_streaming_mode} if non_streaming_mode is not None else {p.non_streaming_mode for p in prompts}
    if len(modes) != 1:
        raise ValueError(f"one official call has one text mode; the prompts ask for {modes}")
    mode = modes.pop()
    call = dict(text=[p.text for p in prompts], language=[p.language for p in prompts], **settings,
                **({} if mode is None else {"non_streaming_mode": mode}))
    if kind == "base":
        return tts.generate_voice_clone(voice_clone_prompt=[voices[p.clone] for p in prompts], **call)
    if kind == "voice_design":
        return tts.generate_voice_design(instruct=[p.instruct for p in prompts], **call)
    return tts.generate_custom_voice(speaker=[p.speaker for p in prompts], instruct=[p.instruct for p in prompts],
                                     **call)


def _official_voices(tts, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """Base: the official voice-clone prompts of reference_voice() (ICL with REFERENCE_TEXT, and
    x-vector only), their speaker embedding and codes recorded in `tensors`; and the meta."""
    wav = reference_voice()
    voices = {"icl": tts.create_voice_clone_prompt((wav, REFERENCE_SAMPLE_RATE), REFERENCE_TEXT, False)[0],
              "x_vector": tts.create_voice_clone_prompt((wav, REFERENCE_SAMPLE_RATE), None, True)[0]}
    embedding = voices["icl"].ref_spk_embedding.detach().float().cpu().clone()
    if not torch.equal(embedding, voices["x_vector"].ref_spk_embedding.float().cpu()):
        raise AssertionError("the official x-vector differs between the ICL and x-vector-only prompts")
    tensors["ref.speaker_embedding"] = embedding
    tensors["ref.codes"] = voices["icl"].ref_code.detach().cpu().clone()
    meta = dict(text=REFERENCE_TEXT, samples=len(wav), sample_rate=REFERENCE_SAMPLE_RATE,
                frames=int(tensors["ref.codes"].shape[0]),
                source="tts_cli.quality.reference.reference_voice() (tests/fixtures/reference-voice-24k.wav)",
                calls=["create_voice_clone_prompt((wav, 24000), ref_text, x_vector_only_mode=False)",
                       "create_voice_clone_prompt((wav, 24000), None, x_vector_only_mode=True)"])
    return voices, meta


def _expected_samples(frames: int, reference_frames: int) -> int:
    """The official waveform's length: an ICL row's decode of reference + frames, less its cut."""
    total = (reference_frames + frames) * SAMPLES_PER_FRAME
    return total - int(reference_frames / max(reference_frames + frames, 1) * total)


def _record(ckpt_dir: Path, prompts, frames: int, attn: str, weights_note: str, device: str,
            natural_max_new_tokens: int, prompt_count: int | None) -> tuple[dict[str, torch.Tensor], dict]:
    tts = load_official(ckpt_dir, attn, device)
    check_loaded_weights(tts, ckpt_dir)
    model, cfg = tts.model, tts.model.config
    talker_cfg = cfg.talker_config
    kind = cfg.tts_model_type
    custom_voice = kind == "custom_voice"
    frames = frames or (FORCED_FRAMES if custom_voice else FORCED_FRAMES_VOICES)
    natural_max_new_tokens = natural_max_new_tokens or (NATURAL_MAX_NEW_TOKENS if custom_voice
                                                        else NATURAL_MAX_NEW_TOKENS_VOICES)
    defaults = PROMPTS_BY_KIND[kind][cfg.tts_model_size] if kind in PROMPTS_BY_KIND else PROMPTS[cfg.tts_model_size]
    prompts = tuple(prompts or defaults)[:prompt_count]
    tokenizer = tts.processor.tokenizer
    special = {t: tokenizer.convert_tokens_to_ids(t) for t, _ in QWEN_SPECIAL_TOKENS}
    special.update(assistant=tokenizer.convert_tokens_to_ids("assistant"), newline=tokenizer.convert_tokens_to_ids("Ċ"))
    template_ids = dict(special, **{"\n": special["newline"], "bpe_vocab_size": special["<|endoftext|>"]})

    settings = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=frames + 1)
    eos, penalty = talker_cfg.codec_eos_token_id, tts._merge_generate_kwargs(**settings)["repetition_penalty"]
    tensors: dict[str, torch.Tensor] = {}
    voices, reference_meta = _official_voices(tts, tensors) if kind == "base" else ({}, None)
    # The code predictor is the same in every kind: the CustomVoice records keep more of its logits.
    cp_logit_frames = CP_LOGIT_FRAMES if kind == "custom_voice" else 1
    rows, checks = [], {"talker_min_margin": float("inf"), "cp_min_margin": float("inf")}

    for i, p in enumerate(prompts):
        reference_frames = int(tensors["ref.codes"].shape[0]) if p.clone == "icl" else 0
        with captured_generate(tts) as gen, TalkerTrace(model.talker) as trace, forced_length():
            wavs, sr = _official_generate(tts, [p], settings, voices)
        codes = gen["codes"][0].cpu()
        if (codes.shape != (frames, 16) or len(wavs[0]) != _expected_samples(frames, reference_frames)
                or sr != 24000):
            raise AssertionError(f"prompt {i}: codes {tuple(codes.shape)}, wav {len(wavs[0])}, sr {sr}")
        input_ids = gen["kwargs"]["input_ids"][0][0].cpu()
        check_template_ids(input_ids.tolist(), template_ids, p.text)
        instruct_ids = (gen["kwargs"].get("instruct_ids") or [None])[0]
        generate_kwargs = _jsonable(gen["kwargs"], skip=("input_ids", "instruct_ids", "languages", "speakers",
                                                         "ref_ids", "voice_clone_prompt"))
        tensors[f"p{i}.input_ids"] = input_ids
        if instruct_ids is not None:
            tensors[f"p{i}.instruct_ids"] = instruct_ids[0].cpu()
        if reference_frames:
            tensors[f"p{i}.ref_ids"] = gen["kwargs"]["ref_ids"][0][0].cpu()
        traced = {k: v.cpu() for k, v in trace.tensors(frames).items()}
        for k, v in traced.items():
            tensors[f"p{i}.{k}"] = v[:cp_logit_frames] if k == "cp_logits" else v
        tensors[f"p{i}.greedy_codes"] = codes
        tensors[f"p{i}.wav"] = torch.from_numpy(wavs[0]).float()
        margins = check_greedy(traced, codes, frames + 1, eos, penalty)
        checks = {k: min(checks[k], margins[k]) for k in checks}

        with captured_generate(tts) as natural:
            _official_generate(tts, [p], dict(settings, max_new_tokens=natural_max_new_tokens), voices)
        natural_codes = natural["codes"][0].cpu()
        tensors[f"p{i}.greedy_codes_natural"] = natural_codes
        n = natural_codes.shape[0]

        language = p.language.lower()
        language_id = None if language == "auto" else talker_cfg.codec_language_id[language]
        dialect = talker_cfg.spk_is_dialect[p.speaker] if p.speaker else False
        if language in ("chinese", "auto") and dialect:
            language_id = talker_cfg.codec_language_id[dialect]
        rows.append(dict(
            index=i, **p.fields(),
            instruct_effective=(p.instruct if instruct_ids is not None else None),
            speaker_codec_id=talker_cfg.spk_id[p.speaker] if p.speaker else None, language_codec_id=language_id,
            prefill_length=int(traced["prefill_embeds"].shape[0]), input_ids_length=int(input_ids.shape[0]),
            forced_frames=frames, max_new_tokens=frames + 1, min_new_tokens=frames + 1,
            natural_frames=n, natural_min_new_tokens=2, natural_max_new_tokens=natural_max_new_tokens,
            natural_stopped_by_eos=n < natural_max_new_tokens - 1,
            natural_equals_forced_prefix=bool(torch.equal(natural_codes[:frames], codes[:n])),
        ))

    # All rows in one call (left-padded lockstep batch), same forced length: CustomVoice in each
    # row's mode (the default); Base and VoiceDesign once per text mode, every row in that mode.
    batch_modes = (None,) if kind == "custom_voice" else (True, False)
    batch_equal = {}
    for mode in batch_modes:
        prefix = "batch" if mode is None else f"batch.non_streaming_{str(mode).lower()}"
        with captured_generate(tts) as gen, forced_length():
            _official_generate(tts, list(prompts), settings, voices, non_streaming_mode=mode)
        batch_equal[prefix] = []
        for i, codes in enumerate(gen["codes"]):
            tensors[f"{prefix}.greedy_codes.{i}"] = codes.cpu()
            same_mode = mode is None or mode == _mode(prompts[i], kind)
            batch_equal[prefix].append(bool(torch.equal(codes.cpu(), tensors[f"p{i}.greedy_codes"])) if same_mode
                                       else None)

    if kind == "custom_voice":   # the codec alone on random codes (the other kinds' waveforms check it too)
        codes = torch.randint(0, 2048, (CODEC_FRAMES, 16), generator=torch.Generator().manual_seed(CODEC_CODES_SEED))
        wavs, _ = model.speech_tokenizer.decode([{"audio_codes": codes}])
        tensors["codec.codes"] = codes
        tensors["codec.wav"] = torch.from_numpy(wavs[0]).float()

    texts = [assistant_text(p.text) for p in prompts]
    checks.update(_tokenizer_agreement(tts, ckpt_dir, texts, [tensors[f"p{i}.input_ids"].tolist()
                                                               for i in range(len(prompts))]))
    if kind == "custom_voice":
        checks["batch_codes_equal_single"] = batch_equal["batch"]
    else:
        checks.update({f"{prefix}_codes_equal_single": equal for prefix, equal in batch_equal.items()})
    for key in [f"p{i}.wav" for i in range(len(prompts))] + (["codec.wav"] if "codec.wav" in tensors else []):
        wav = tensors[key]
        checks[f"{key}.rms"] = float(wav.pow(2).mean().sqrt())
        checks[f"{key}.clipped_fraction"] = float((wav.abs() >= 1).float().mean())

    method = {"base": "generate_voice_clone(text, language, voice_clone_prompt=[prompt], non_streaming_mode",
              "voice_design": "generate_voice_design(text, instruct, language, non_streaming_mode",
              "custom_voice": "generate_custom_voice(text, speaker, language, instruct"}[kind]
    codec_cfg = model.speech_tokenizer.model.config
    meta = dict(
        source="official qwen_tts (qwen-tts-hf) via tts_cli.quality.reference.record",
        checkpoint=_display_path(ckpt_dir),
        tts_model_size=cfg.tts_model_size,
        **({} if kind == "custom_voice" else {"tts_model_type": kind}),
        load=dict(call="qwen_tts.Qwen3TTSModel.from_pretrained(dir, dtype=torch.float32, "
                       f"attn_implementation={attn!r})", device=device, dtype="float32",
                  **({} if device == "cpu" else {"tf32": False})),
        attn_implementation=dict(talker=talker_cfg._attn_implementation,
                                 code_predictor=talker_cfg.code_predictor_config._attn_implementation,
                                 codec=codec_cfg.decoder_config._attn_implementation),
        generation=dict(
            call=f"{method}, do_sample=False, "
                 "subtalker_dosample=False, max_new_tokens=F+1); the rest from generation_config.json",
            generate_kwargs=generate_kwargs,
            forced="Qwen3TTSTalkerForConditionalGeneration.generate wrapped: min_new_tokens = max_new_tokens",
            forced_frames=frames, max_new_tokens=frames + 1, min_new_tokens=frames + 1,
            natural_min_new_tokens=2, codec_eos_token_id=eos, repetition_penalty=penalty,
            suppressed_talker_ids="2048..3071 except codec_eos_token_id"),
        tokenizer=dict(vocab_size=len(tokenizer), bpe_vocab_size=special["<|endoftext|>"],
                       text_vocab_size=talker_cfg.text_vocab_size, special_ids=special),
        weights=weights_note,
        **({} if reference_meta is None else {"reference": reference_meta}),
        prompts=rows,
        batch=(dict(rows=len(prompts), forced_frames=frames, codes_equal_single=batch_equal["batch"])
               if kind == "custom_voice" else
               dict(rows=len(prompts), forced_frames=frames, calls={prefix: dict(non_streaming_mode=mode)
                                                                    for prefix, mode in zip(batch_equal, batch_modes)},
                    codes_equal_single=batch_equal)),
        **({"codec": dict(frames=CODEC_FRAMES, seed=CODEC_CODES_SEED,
                          call="model.speech_tokenizer.decode([{'audio_codes': codes}])")}
           if "codec.codes" in tensors else {}),
        checks=checks,
        versions=_versions(),
        tensors={k: dict(shape=list(v.shape), dtype=str(v.dtype).replace("torch.", "")) for k, v in tensors.items()},
    )
    return tensors, meta


def _mode(prompt: Prompt, kind: str) -> bool:
    """A prompt's text mode: its own, else the official default of the kind's method."""
    if prompt.non_streaming_mode is not None:
        return prompt.non_streaming_mode
    return kind != "base"


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
    try:   # the earlier records' date, where they are there and read (else they are replaced)
        old = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        old = None
    if isinstance(old, dict) and {k: v for k, v in old.items() if k != "date"} == json.loads(json.dumps(meta)):
        date = old.get("date", date)
    write_json(meta_path, dict(meta, date=date))
