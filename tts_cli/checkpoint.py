"""The official Qwen3-TTS-12Hz checkpoint layout -> typed configs and tensors.

A checkpoint directory holds config.json, generation_config.json, model.safetensors (or shards
with model.safetensors.index.json), the Qwen2 tokenizer files and speech_tokenizer/ (the codec).
Every special id, speaker, language, dialect and sampling default is read from these files; a
missing or malformed file raises CheckpointError naming it.

Three kinds (config.json `tts_model_type`), as the official wrapper's three generate methods:
"custom_voice" (named speakers, optional instruct), "base" (voice cloning from a reference: its
model.safetensors also holds `speaker_encoder.*`, the x-vector encoder) and "voice_design" (the
instruct describes the voice; no speakers).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tts_cli.config_file import ConfigFields, read_json
from tts_cli.errors import CheckpointError, UnsupportedModelError
from tts_cli.model.speaker_encoder import SpeakerEncoderConfig


@dataclass(frozen=True)
class DecoderConfig:
    """One Qwen3 decoder stack (the talker's or the code predictor's)."""
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool

    @classmethod
    def parse(cls, f: ConfigFields) -> "DecoderConfig":
        hidden = f.get("hidden_size", int)
        heads = f.get("num_attention_heads", int)
        kv_heads = f.get("num_key_value_heads", int, heads)
        if heads % kv_heads:
            raise CheckpointError(f"{f.where}: num_attention_heads {heads} is not a multiple of "
                                  f"num_key_value_heads {kv_heads}")
        act = f.get("hidden_act", str, "silu")
        if act != "silu":
            raise CheckpointError(f"{f.where}: hidden_act '{act}' is not supported (only 'silu')")
        layer_types = f.get("layer_types", list, [])
        if any(t != "full_attention" for t in layer_types) or f.get("use_sliding_window", bool, False):
            raise CheckpointError(f"{f.where}: sliding-window attention layers are not supported")
        return cls(
            hidden_size=hidden,
            intermediate_size=f.get("intermediate_size", int),
            num_layers=f.get("num_hidden_layers", int),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=f.get("head_dim", int, hidden // heads),
            rms_norm_eps=f.get("rms_norm_eps", float, 1e-6),
            rope_theta=f.get("rope_theta", float, 10000.0),
            attention_bias=f.get("attention_bias", bool, False),
        )


CUSTOM_VOICE, BASE, VOICE_DESIGN = "custom_voice", "base", "voice_design"
MODEL_KINDS = {CUSTOM_VOICE: "CustomVoice", BASE: "Base", VOICE_DESIGN: "VoiceDesign"}
MODEL_SIZES = {"1b7": "1.7B", "0b6": "0.6B"}   # config.json's tts_model_size, as messages say it
SPEAKER_ENCODER_PREFIX = "speaker_encoder."


@dataclass(frozen=True)
class ModelConfig:
    """config.json of a checkpoint: model shapes and every id the prompt needs."""
    model_size: str                 # "1b7" or "0b6" as written in the checkpoint
    talker: DecoderConfig
    code_predictor: DecoderConfig
    text_vocab_size: int
    text_hidden_size: int
    codec_vocab_size: int           # talker vocabulary: 2048 audio codes + specials
    code_vocab_size: int            # code predictor vocabulary (per group)
    num_code_groups: int
    # text-side special ids
    im_start_id: int
    im_end_id: int
    tts_pad_id: int
    tts_bos_id: int
    tts_eos_id: int
    # codec-side special ids
    codec_pad_id: int
    codec_bos_id: int
    codec_eos_id: int
    codec_think_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    speaker_ids: dict[str, int]
    speaker_dialects: dict[str, str]       # speaker -> dialect language, only for dialect speakers
    language_ids: dict[str, int]           # includes dialect entries
    model_type: str = CUSTOM_VOICE         # tts_model_type: CUSTOM_VOICE, BASE or VOICE_DESIGN
    speaker_encoder: SpeakerEncoderConfig | None = None   # Base checkpoints only
    # The tokenizer's added tokens (tokenizer_config.json: <|im_end|>, <tts_pad>, <think>, ...): written
    # in a row's text, each is read whole as that one token, not spoken (as the official prompt string
    # reads it too).
    added_tokens: tuple[str, ...] = ()

    @property
    def kind_name(self) -> str:
        """"CustomVoice", "Base" or "VoiceDesign", for messages."""
        return MODEL_KINDS[self.model_type]

    @property
    def name(self) -> str:
        """E.g. "CustomVoice 0.6B", for messages."""
        return f"{self.kind_name} {MODEL_SIZES.get(self.model_size, self.model_size)}"

    @property
    def supports_instruct(self) -> bool:
        # The official wrapper drops instructs for a CustomVoice 0.6B with `tts_model_size in "0b6"`;
        # generate_voice_design takes one; generate_voice_clone has none.
        if self.model_type == VOICE_DESIGN:
            return True
        return self.model_type == CUSTOM_VOICE and self.model_size not in "0b6"

    @property
    def default_non_streaming_mode(self) -> bool:
        """The official default of `non_streaming_mode`: False for generate_voice_clone (the text fed
        one token per frame), True for generate_custom_voice and generate_voice_design."""
        return self.model_type != BASE

    @property
    def languages(self) -> list[str]:
        """Languages a user may ask for: 'auto' plus every non-dialect entry, as the official API."""
        return ["auto"] + sorted(k for k in self.language_ids if "dialect" not in k)

    @property
    def speakers(self) -> list[str]:
        return sorted(self.speaker_ids)

    @classmethod
    def parse(cls, data: dict, path: Path) -> "ModelConfig":
        top = ConfigFields(data, str(path))
        kind = top.get("tts_model_type", str)
        if kind not in MODEL_KINDS:
            raise UnsupportedModelError(
                f"{path}: tts_model_type '{kind}' is not supported; tts synthesizes "
                f"{', '.join(MODEL_KINDS)} checkpoints (Qwen3-TTS-12Hz CustomVoice, Base and VoiceDesign)")
        tokenizer_type = top.get("tokenizer_type", str)
        if tokenizer_type != "qwen3_tts_tokenizer_12hz":
            raise UnsupportedModelError(f"{path}: tokenizer_type '{tokenizer_type}' is not supported yet "
                                        "(only the 12 Hz codec, qwen3_tts_tokenizer_12hz)")
        talker = top.sub("talker_config")
        cp = talker.sub("code_predictor_config")
        talker_cfg = DecoderConfig.parse(talker)
        cp_cfg = DecoderConfig.parse(cp)
        groups = talker.get("num_code_groups", int)
        if cp.get("num_code_groups", int, groups) != groups:
            raise CheckpointError(f"{path}: talker and code predictor disagree on num_code_groups")

        speaker_ids = codec_ids(talker, "spk_id")
        dialects = {k.lower(): v for k, v in talker.get("spk_is_dialect", dict, {}).items() if v}
        language_ids = codec_ids(talker, "codec_language_id")
        for spk, dialect in dialects.items():
            if dialect not in language_ids:
                raise CheckpointError(f"{path}: speaker '{spk}' has dialect '{dialect}', "
                                      "which is not in codec_language_id")
        speaker_encoder = None
        if kind == BASE:   # the official model builds a speaker encoder for Base checkpoints only
            speaker_encoder = SpeakerEncoderConfig.from_fields(
                top.sub("speaker_encoder_config") if "speaker_encoder_config" in top.data
                else ConfigFields({}, f"{path} -> speaker_encoder_config"))
            if speaker_encoder.enc_dim != talker_cfg.hidden_size:
                raise CheckpointError(f"{path}: speaker_encoder_config enc_dim {speaker_encoder.enc_dim} differs "
                                      f"from the talker's hidden_size {talker_cfg.hidden_size} (the x-vector is a "
                                      "talker input)")
        return cls(
            model_size=top.get("tts_model_size", str),
            talker=talker_cfg,
            code_predictor=cp_cfg,
            text_vocab_size=talker.get("text_vocab_size", int),
            text_hidden_size=talker.get("text_hidden_size", int),
            codec_vocab_size=talker.get("vocab_size", int),
            code_vocab_size=cp.get("vocab_size", int),
            num_code_groups=groups,
            im_start_id=top.get("im_start_token_id", int),
            im_end_id=top.get("im_end_token_id", int),
            tts_pad_id=top.get("tts_pad_token_id", int),
            tts_bos_id=top.get("tts_bos_token_id", int),
            tts_eos_id=top.get("tts_eos_token_id", int),
            codec_pad_id=talker.get("codec_pad_id", int),
            codec_bos_id=talker.get("codec_bos_id", int),
            codec_eos_id=talker.get("codec_eos_token_id", int),
            codec_think_id=talker.get("codec_think_id", int),
            codec_nothink_id=talker.get("codec_nothink_id", int),
            codec_think_bos_id=talker.get("codec_think_bos_id", int),
            codec_think_eos_id=talker.get("codec_think_eos_id", int),
            speaker_ids=speaker_ids,
            speaker_dialects=dialects,
            language_ids=language_ids,
            model_type=kind,
            speaker_encoder=speaker_encoder,
        )


def codec_ids(talker: ConfigFields, key: str) -> dict[str, int]:
    """A name -> codec id mapping of talker_config (spk_id, codec_language_id), its names lowercased. Each id
    is a row of the talker's codec embedding: another value would fail the run only when a row names it."""
    vocab = talker.get("vocab_size", int)
    mapping = talker.get(key, dict)
    for name, value in mapping.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
            raise CheckpointError(f"{talker.where}: field '{key}': '{name}' should be a codec id, an integer from 0 "
                                  f"to vocab_size - 1 ({vocab - 1}), got {value!r}")
    return {name.lower(): value for name, value in mapping.items()}


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings for the talker (codebook 0) and the code predictor (codebooks 1..15).

    Defaults are the official hard defaults; generation_config.json overrides them, the CLI
    overrides that."""
    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    subtalker_do_sample: bool = True
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    max_new_tokens: int = 2048

    @classmethod
    def parse(cls, data: dict, path: Path) -> "SamplingConfig":
        f = ConfigFields(data, str(path))
        base = cls()
        config = cls(
            do_sample=f.get("do_sample", bool, base.do_sample),
            temperature=f.get("temperature", float, base.temperature),
            top_k=f.get("top_k", int, base.top_k, minimum=0),   # 0: no top-k
            top_p=f.get("top_p", float, base.top_p),
            repetition_penalty=f.get("repetition_penalty", float, base.repetition_penalty),
            subtalker_do_sample=f.get("subtalker_dosample", bool, base.subtalker_do_sample),
            subtalker_temperature=f.get("subtalker_temperature", float, base.subtalker_temperature),
            subtalker_top_k=f.get("subtalker_top_k", int, base.subtalker_top_k, minimum=0),
            subtalker_top_p=f.get("subtalker_top_p", float, base.subtalker_top_p),
            # the last drawn token gets no frame: fewer than 2 would make every row empty audio
            max_new_tokens=f.get("max_new_tokens", int, base.max_new_tokens, minimum=2),
        )
        # The bounds of HF's warpers, which the official code samples with: a temperature or penalty of 0 divides
        # by zero, a negative one turns the distribution over (the temperatures only matter when sampling).
        for key, value, checked in (("temperature", config.temperature, config.do_sample),
                                    ("subtalker_temperature", config.subtalker_temperature, config.subtalker_do_sample),
                                    ("repetition_penalty", config.repetition_penalty, True)):
            if checked and not value > 0:
                raise CheckpointError(f"{path}: field '{key}' should be > 0, got {value!r}")
        for key, value in (("top_p", config.top_p), ("subtalker_top_p", config.subtalker_top_p)):
            if not 0 <= value <= 1:
                raise CheckpointError(f"{path}: field '{key}' should be from 0 to 1, got {value!r}")
        return config

    def greedy(self) -> "SamplingConfig":
        """The official do_sample=False, subtalker_dosample=False: argmax in both samplers."""
        from dataclasses import replace
        return replace(self, do_sample=False, subtalker_do_sample=False)


def check_tensors(model: torch.nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """Every tensor of `model` is in `state` with its shape: else CheckpointError naming it."""
    for name, expected in model.state_dict().items():
        if name not in state:
            raise CheckpointError(f"{what}: tensor {name} is missing")
        if tuple(state[name].shape) != tuple(expected.shape):
            raise CheckpointError(f"{what}: tensor {name} has shape {list(state[name].shape)}, "
                                  f"expected {list(expected.shape)}")


def weight_files(model_dir: Path, name: str = "model.safetensors") -> list[Path]:
    """The single weights file, or the shards that `<name>.index.json` lists; CheckpointError names the first
    one missing. Only the index is read, not the weights."""
    single, index = model_dir / name, model_dir / f"{name}.index.json"
    if single.is_file():
        return [single]
    if not index.is_file():
        raise CheckpointError(f"missing file: {single} (or sharded {index})")
    weight_map = ConfigFields(read_json(index), str(index)).get("weight_map", dict)
    files = [model_dir / shard for shard in sorted(set(weight_map.values()))]
    for path in files:
        if not path.is_file():
            raise CheckpointError(f"missing file: {path} (listed in {index})")
    return files


def load_safetensors(model_dir: Path, name: str = "model.safetensors", prefix: str = "") -> dict[str, torch.Tensor]:
    """Tensors of a single file or of shards listed in `<name>.index.json`; with a prefix, only those
    whose names start with it (read alone: the speaker encoder's few MB, not the talker's GBs)."""
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir, name):
        try:
            with safe_open(str(path), framework="pt") as file:
                tensors.update({key: file.get_tensor(key) for key in file.keys() if key.startswith(prefix)})
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"malformed safetensors file {path}: {e}") from None
    return tensors


@dataclass
class Checkpoint:
    root: Path
    config: ModelConfig
    sampling: SamplingConfig

    @property
    def speech_tokenizer_dir(self) -> Path:
        return self.root / "speech_tokenizer"

    def tensors(self) -> dict[str, torch.Tensor]:
        return load_safetensors(self.root)

    def speaker_encoder_tensors(self) -> dict[str, torch.Tensor]:
        """A Base checkpoint's `speaker_encoder.*` tensors, keyed without that prefix (e.g.
        "blocks.0.conv.weight", the official module's state_dict names)."""
        if self.config.model_type != BASE:
            raise CheckpointError(f"{self.root}: a {self.config.kind_name} checkpoint has no speaker encoder "
                                  "(only Base checkpoints clone voices)")
        found = {key[len(SPEAKER_ENCODER_PREFIX):]: t for key, t in self.tensors().items()
                 if key.startswith(SPEAKER_ENCODER_PREFIX)}
        if not found:
            raise CheckpointError(f"{self.root / 'model.safetensors'}: a Base checkpoint without "
                                  f"{SPEAKER_ENCODER_PREFIX}* tensors (the speaker encoder)")
        return found


TOKENIZER_FILES = ("tokenizer_config.json",)
CODEC_FILES = ("config.json", "model.safetensors")   # in speech_tokenizer/: what load_codec reads
FINGERPRINT_SAMPLE = 1 << 20   # bytes read from each weights file's middle


def fingerprint(model_dir: str | Path) -> str:
    """A short hash that tells one checkpoint's files from another's put in the same folder: the
    configs whole, and each weights file's (shards too) size and a megabyte from its middle
    (different weights differ there; the same checkpoint downloaded again does not). Reads a few MB,
    not gigabytes."""
    root, digest = Path(model_dir), hashlib.sha256()
    for name in ("config.json", "generation_config.json", "speech_tokenizer/config.json"):
        path = root / name
        digest.update(path.read_bytes() if path.is_file() else b"-")
    for path in sorted(root.glob("*.safetensors")) + sorted(root.glob("speech_tokenizer/*.safetensors")):
        size = path.stat().st_size
        with open(path, "rb") as f:
            f.seek(max(0, size // 2 - FINGERPRINT_SAMPLE // 2))
            digest.update(f"{size}:".encode() + f.read(FINGERPRINT_SAMPLE))
    return digest.hexdigest()[:16]


def open_checkpoint(model_dir: str | Path) -> Checkpoint:
    """Validates the layout (every file there, the weights too) and parses the configs; tensors are loaded
    later, on demand."""
    root = Path(model_dir)
    if not root.is_dir():
        raise CheckpointError(f"model directory not found: {root}")
    config = ModelConfig.parse(read_json(root / "config.json"), root / "config.json")
    gen_path = root / "generation_config.json"
    sampling = SamplingConfig.parse(read_json(gen_path), gen_path) if gen_path.exists() else SamplingConfig()
    for name in TOKENIZER_FILES:
        if not (root / name).is_file():
            raise CheckpointError(f"missing tokenizer file: {root / name}")
    added = read_json(root / "tokenizer_config.json").get("added_tokens_decoder") or {}
    config = replace(config, added_tokens=tuple(sorted(
        token["content"] for token in added.values() if isinstance(token, dict) and token.get("content"))))
    if not (root / "tokenizer.json").is_file() and not (
            (root / "vocab.json").is_file() and (root / "merges.txt").is_file()):
        raise CheckpointError(f"missing tokenizer files in {root}: need tokenizer.json or vocab.json + merges.txt")
    # Present, not read (GBs): an incomplete download stops here, before a run makes its output folder.
    weight_files(root)
    speech = root / "speech_tokenizer"
    if not speech.is_dir():
        raise CheckpointError(f"missing directory: {speech} (the 12 Hz codec)")
    for name in CODEC_FILES:
        if not (speech / name).is_file():
            raise CheckpointError(f"missing file: {speech / name}")
    return Checkpoint(root=root, config=config, sampling=sampling)
