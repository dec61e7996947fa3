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
