"""What travels down the data path: one Request per manifest row, one Result per synthesized row."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(eq=False)
class VoiceReference:
    """The voice a Base checkpoint clones, already encoded from the reference audio (24 kHz mono):
    the official create_voice_clone_prompt's VoiceClonePromptItem. Compared by identity."""
    speaker_embedding: torch.Tensor          # [D] float: the x-vector (D = the talker width)
    codes: torch.Tensor | None = None        # [frames, 16] int64 codec codes: ICL; None: x-vector only
    text: str | None = None                  # the reference's transcript (ICL needs it; x-vector only ignores it)
    name: str = ""                           # for messages: e.g. the reference file

    @property
    def x_vector_only(self) -> bool:
        return self.codes is None


@dataclass
class Request:
    id: str
    text: str
    speaker: str | None = None               # CustomVoice only
    language: str = "auto"
    instruct: str | None = None              # CustomVoice 1.7B (optional) and VoiceDesign (the voice)
    seed: int = 0
    reference: VoiceReference | None = None  # Base only: the voice to clone
    # The official argument of that name: True feeds the whole text in the prompt, False one text
    # token per frame beside the codes ("streaming" text). None: the official default for the
    # checkpoint's kind (False for Base, True for CustomVoice and VoiceDesign).
    non_streaming_mode: bool | None = None


@dataclass
class Result:
    id: str
    codes: torch.Tensor          # [frames, 16] int64 codec codes
    audio: np.ndarray            # [frames * 1920] float32 in [-1, 1], 24 kHz
    hit_cap: bool = False        # stopped by the frame cap, not by EOS
    extra: dict = field(default_factory=dict)

    @property
    def frames(self) -> int:
        return int(self.codes.shape[0])
