"""CustomVoice prompt construction (the official non-streaming text mode).

A prompt is a list of positions, each the sum of a text-track vector (the projected text
embedding) and, where present, a codec-track vector (a row of the talker's codec table):

    [instruct tokens]                       text only (1.7B, optional)
    <|im_start|> assistant \\n               text only
    tts_pad + think | nothink, think_bos, [language], think_eos, speaker
    tts_bos + codec_pad
    text token_i + codec_pad  ...  tts_eos + codec_pad
    tts_pad + codec_bos                     <- its output predicts codebook 0 of frame 0
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tts_cli.checkpoint import ModelConfig
from tts_cli.errors import RequestError

NO_CODEC = -1


@dataclass
class Prompt:
    text_ids: list[int]
    codec_ids: list[int]        # NO_CODEC where a position has no codec track
    text_tokens: int            # tokens of the text to speak (sets the default frame cap)

    def __len__(self) -> int:
        return len(self.text_ids)


def assistant_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def instruct_text(instruct: str) -> str:
    return f"<|im_start|>user\n{instruct}<|im_end|>\n"


def resolve_language_id(cfg: ModelConfig, speaker: str, language: str) -> int | None:
    """The codec language id, with the dialect override for dialect speakers ('auto' -> None)."""
    lang = language.lower()
    if lang not in cfg.languages:
        raise RequestError(f"unknown language '{language}'; valid: {', '.join(cfg.languages)}")
    language_id = None if lang == "auto" else cfg.language_ids[lang]
    dialect = cfg.speaker_dialects.get(speaker.lower())
    if dialect and lang in ("chinese", "auto"):
        language_id = cfg.language_ids[dialect]
    return language_id


def check_speaker(cfg: ModelConfig, speaker: str) -> None:
    if not speaker or speaker.lower() not in cfg.speaker_ids:
        raise RequestError(f"unknown speaker '{speaker}'; valid: {', '.join(cfg.speakers)}")


def build_prompt(cfg: ModelConfig, text_ids: list[int], speaker: str, language: str,
                 instruct_ids: list[int] | None = None) -> Prompt:
    """text_ids: the tokenized assistant_text(text); instruct_ids: tokenized instruct_text()."""
    check_speaker(cfg, speaker)
    if len(text_ids) < 9 or text_ids[0] != cfg.im_start_id or text_ids[-5] != cfg.im_end_id:
        raise RequestError("text tokenizes to an unexpected layout (does it start with a newline "
                           "or contain chat-template tokens?)")
    language_id = resolve_language_id(cfg, speaker, language)
    role, body = text_ids[:3], text_ids[3:-5]

    control = ([cfg.codec_nothink_id, cfg.codec_think_bos_id, cfg.codec_think_eos_id] if language_id is None
               else [cfg.codec_think_id, cfg.codec_think_bos_id, language_id, cfg.codec_think_eos_id])
    control += [cfg.speaker_ids[speaker.lower()], cfg.codec_pad_id]

    text = list(instruct_ids or []) + role
    codec = [NO_CODEC] * len(text)
    text += [cfg.tts_pad_id] * (len(control) - 1) + [cfg.tts_bos_id]
    codec += control
    text += body + [cfg.tts_eos_id]
    codec += [cfg.codec_pad_id] * (len(body) + 1)
    text.append(cfg.tts_pad_id)
    codec.append(cfg.codec_bos_id)
    return Prompt(text_ids=text, codec_ids=codec, text_tokens=len(body))


def prompt_embeddings(talker, prompt: Prompt) -> torch.Tensor:
    """[len(prompt), H] talker input vectors."""
    device = talker.codec_embedding.weight.device
    text_ids = torch.tensor(prompt.text_ids, device=device)
    codec_ids = torch.tensor(prompt.codec_ids, device=device)
    embeds = talker.text_track(text_ids)
    has_codec = codec_ids != NO_CODEC
    codec = talker.codec_track(codec_ids.clamp(min=0))
    return torch.where(has_codec[:, None], embeds + codec, embeds)
