"""Talker prompts of the three checkpoint kinds, as the official Qwen3TTSForConditionalGeneration.generate
builds them (CustomVoice: a named speaker; Base: a cloned voice; VoiceDesign: the instruct only).

A prompt is a list of positions, each the sum of a text-track vector (the projected text
embedding) and, where present, a codec-track vector: a row of the talker's codec table, the
reference's x-vector, or a reference frame (the sum of its 16 codebook embeddings):

    [instruct tokens]                       text only (CustomVoice 1.7B, VoiceDesign; optional)
    <|im_start|> assistant \\n               text only
    tts_pad + think | nothink, think_bos, [language], think_eos, [speaker or x-vector]
    tts_bos + codec_pad
    then one of
      non-streaming text (non_streaming_mode=True):
        text token_i + codec_pad  ...  tts_eos + codec_pad
        tts_pad + codec_bos                 <- its output predicts codebook 0 of frame 0
      streaming text (False):
        text token_0 + codec_bos            the other tokens and tts_eos are the trailing text:
                                            one added to each decode step's input, then tts_pad
      ICL (a reference with codes), non-streaming:
        ref text token_i + codec_pad ... text token_i + codec_pad ... tts_eos + codec_pad
        tts_pad + codec_bos, tts_pad + reference frame_k ...
      ICL, streaming: the text track (ref text, text, tts_eos) beside the codec track (codec_bos,
        reference frames) position by position; the longer text continues as trailing text, the
        shorter is padded with tts_pad.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from tts_cli.checkpoint import ModelConfig
from tts_cli.errors import RequestError
from tts_cli.model.host import to_device

NO_CODEC = -1            # a position without a codec track
SPEAKER_EMBEDDING = -2   # the codec track is the prompt's speaker embedding (x-vector)
REFERENCE_FRAME = -3     # the codec track is the next reference frame (in order)


@dataclass
class Prompt:
    text_ids: list[int]
    codec_ids: list[int]        # a codec id, or NO_CODEC / SPEAKER_EMBEDDING / REFERENCE_FRAME
    text_tokens: int            # tokens of the text to speak (sets the default frame cap)
    trailing_text_ids: list[int] = field(default_factory=list)   # streaming text: one per decode step
    speaker_embedding: torch.Tensor | None = None   # [H], at the SPEAKER_EMBEDDING position
    reference_codes: torch.Tensor | None = None     # [frames, 16], at the REFERENCE_FRAME positions
    voice_positions: int = 0    # the leading positions set by the voice and language alone (voice_prefix)

    def __len__(self) -> int:
        return len(self.text_ids)

    def voice_prefix(self) -> tuple | None:
        """What sets the positions before the text, which every prompt of this voice and language
        shares (their keys and values do not depend on what follows, so the engine computes them
        once): their ids (the role, the codec control tokens; a cloned voice's reference transcript
        and, streamed beside it, its first frames), then for a cloned voice a digest of its x-vector
        and of those frames. None for a prompt with an instruct (as many prefixes as instructs) and
        for a cloned voice held on a GPU (its digest would make the host wait for it)."""
        if not self.voice_positions:
            return None
        text, codec = tuple(self.text_ids[:self.voice_positions]), tuple(self.codec_ids[:self.voice_positions])
        frames = codec.count(REFERENCE_FRAME)
        tensors = ([self.speaker_embedding] if SPEAKER_EMBEDDING in codec else []) + \
            ([self.reference_codes[:frames]] if frames else [])
        if not tensors:
            return text, codec
        if any(t.device.type != "cpu" for t in tensors):
            return None
        digest = hashlib.blake2b(digest_size=16)
        for t in tensors:
            digest.update(str((t.dtype, tuple(t.shape))).encode())
            digest.update(t.detach().contiguous().numpy().tobytes())
        return text, codec, digest.hexdigest()


def assistant_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def reference_text(text: str) -> str:
    """The official wrapper's template for an ICL reference transcript (_build_ref_text)."""
    return f"<|im_start|>assistant\n{text}<|im_end|>\n"


def instruct_text(instruct: str) -> str:
    return f"<|im_start|>user\n{instruct}<|im_end|>\n"


def resolve_language_id(cfg: ModelConfig, speaker: str | None, language: str) -> int | None:
    """The codec language id, with the dialect override for dialect speakers ('auto' -> None)."""
    lang = language.lower()
    if lang not in cfg.languages:
        raise RequestError(f"unknown language '{language}'; valid: {', '.join(cfg.languages)}")
    language_id = None if lang == "auto" else cfg.language_ids[lang]
    dialect = cfg.speaker_dialects.get(speaker.lower()) if speaker else None
    if dialect and lang in ("chinese", "auto"):
        language_id = cfg.language_ids[dialect]
    return language_id


def check_speaker(cfg: ModelConfig, speaker: str | None) -> None:
    if not speaker or speaker.lower() not in cfg.speaker_ids:
        raise RequestError(f"unknown speaker '{speaker or ''}'; valid: {', '.join(cfg.speakers)}")


def _text_body(cfg: ModelConfig, ids: list[int], tail: int, what: str) -> list[int]:
    """The tokens between the 3-token role and the `tail` template tokens (the official slices
    [3:-5] of the text, [3:-2] of a reference transcript)."""
    if len(ids) < 4 + tail or ids[0] != cfg.im_start_id or ids[-tail] != cfg.im_end_id:
        raise RequestError(f"{what} tokenizes to an unexpected layout (does it start with a newline "
                           "or contain chat-template tokens?)")
    return ids[3:-tail]


def build_prompt(cfg: ModelConfig, text_ids: list[int], speaker: str | None, language: str,
                 instruct_ids: list[int] | None = None, non_streaming_mode: bool = True,
                 speaker_embedding: torch.Tensor | None = None, reference_ids: list[int] | None = None,
                 reference_codes: torch.Tensor | None = None) -> Prompt:
    """text_ids: the tokenized assistant_text(text); instruct_ids: tokenized instruct_text().
    speaker: a CustomVoice speaker name, or None (Base, VoiceDesign). speaker_embedding [H]: the
    x-vector of a cloned voice (Base); with reference_ids (tokenized reference_text()) and
    reference_codes [frames, 16] the prompt is ICL. Checks of what a checkpoint kind allows are
    the synthesizer's; this builds what it is given."""
    if speaker is not None:
        check_speaker(cfg, speaker)
    body = _text_body(cfg, text_ids, 5, "text")
    language_id = resolve_language_id(cfg, speaker, language)
    role = text_ids[:3]

    control = ([cfg.codec_nothink_id, cfg.codec_think_bos_id, cfg.codec_think_eos_id] if language_id is None
               else [cfg.codec_think_id, cfg.codec_think_bos_id, language_id, cfg.codec_think_eos_id])
    if speaker is not None:
        control.append(cfg.speaker_ids[speaker.lower()])
    elif speaker_embedding is not None:
        control.append(SPEAKER_EMBEDDING)
    control.append(cfg.codec_pad_id)      # the codec_bos that ends the official list comes with the text below

    text = list(instruct_ids or []) + role
    codec = [NO_CODEC] * len(text)
    text += [cfg.tts_pad_id] * (len(control) - 1) + [cfg.tts_bos_id]
    codec += control
    voice_positions = 0 if instruct_ids else len(text)
    trailing: list[int] = []
    if reference_codes is not None:
        ref_body = _text_body(cfg, reference_ids or [], 2, "reference text")
        icl_text = ref_body + body + [cfg.tts_eos_id]
        icl_codec = [cfg.codec_bos_id] + [REFERENCE_FRAME] * reference_codes.shape[0]
        if voice_positions:   # the transcript's positions (beside pads, or streamed beside the first frames)
            voice_positions += len(ref_body) if non_streaming_mode else min(len(ref_body), len(icl_codec))
        if non_streaming_mode:
            text += icl_text + [cfg.tts_pad_id] * len(icl_codec)
            codec += [cfg.codec_pad_id] * len(icl_text) + icl_codec
        else:
            paired = len(icl_codec)
            text += icl_text[:paired] + [cfg.tts_pad_id] * (paired - len(icl_text))
            codec += icl_codec
            trailing = icl_text[paired:]
    elif non_streaming_mode:
        text += body + [cfg.tts_eos_id, cfg.tts_pad_id]
        codec += [cfg.codec_pad_id] * (len(body) + 1) + [cfg.codec_bos_id]
    else:
        text.append(body[0])
        codec.append(cfg.codec_bos_id)
        trailing = body[1:] + [cfg.tts_eos_id]
    return Prompt(text_ids=text, codec_ids=codec, text_tokens=len(body), trailing_text_ids=trailing,
                  speaker_embedding=speaker_embedding, reference_codes=reference_codes,
                  voice_positions=voice_positions)


def prompt_embeddings(talker, prompt: Prompt, code_predictor=None) -> torch.Tensor:
    """[len(prompt), H] talker input vectors. code_predictor: the model's, for prompts with
    reference frames (its codebook 1..15 embeddings). Queues GPU work only: the special codec
    positions are found in the host's list (a mask on the device would wait for it)."""
    device = talker.codec_embedding.weight.device
    text_ids = to_device(prompt.text_ids, device)
    codec_ids = to_device(prompt.codec_ids, device)
    embeds = talker.text_track(text_ids)
    codec = talker.codec_track(codec_ids.clamp(min=0))
    if prompt.speaker_embedding is not None and SPEAKER_EMBEDDING in prompt.codec_ids:
        codec[prompt.codec_ids.index(SPEAKER_EMBEDDING)] = to_device(prompt.speaker_embedding, device).to(codec.dtype)
    if prompt.reference_codes is not None:
        if code_predictor is None:
            raise ValueError("a prompt with reference frames needs the code predictor's embeddings")
        start, count = prompt.codec_ids.index(REFERENCE_FRAME), prompt.reference_codes.shape[0]
        if prompt.codec_ids[start:start + count] != [REFERENCE_FRAME] * count \
                or prompt.codec_ids.count(REFERENCE_FRAME) != count:
            raise ValueError(f"the prompt's reference frame positions are not one run of {count}")
        codec[start:start + count] = reference_frame_embeddings(talker, code_predictor, prompt.reference_codes)
    return torch.where((codec_ids != NO_CODEC)[:, None], embeds + codec, embeds)


def reference_frame_embeddings(talker, code_predictor, codes: torch.Tensor) -> torch.Tensor:
    """[frames, H]: each reference frame as the talker input a generated frame would be (without
    text): the sum of its 16 codebook embeddings (official generate_icl_prompt)."""
    codes = to_device(codes, talker.codec_embedding.weight.device)
    return code_predictor.frame_embedding(talker.codec_track(codes[:, 0]), codes[:, 1:])


def trailing_text_embeddings(talker, prompt: Prompt) -> torch.Tensor | None:
    """[N, H] text-track vectors of the streaming text mode, one per decode step (None: none)."""
    if not prompt.trailing_text_ids:
        return None
    return talker.text_track(to_device(prompt.trailing_text_ids, talker.codec_embedding.weight.device))
