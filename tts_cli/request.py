"""What travels down the data path: one Request per manifest row, one Result per synthesized row."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Request:
    id: str
    text: str
    speaker: str
    language: str = "auto"
    instruct: str | None = None
    seed: int = 0
    # Voice cloning (Base checkpoints), from the manifest's ref_* columns or --ref-* options
    # (tts_cli/voice/): a request with ref_audio clones that reference's voice.
    ref_audio: str | None = None          # absolute path of the reference file
    ref_audio_sha256: str | None = None   # SHA-256 of its bytes when the manifest was checked
    ref_text: str | None = None           # the reference's transcript: ICL mode needs it
    x_vector_only: bool = False           # the speaker embedding only (no ICL, no ref_text needed)

    @property
    def clones_voice(self) -> bool:
        return self.ref_audio is not None


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
