"""The talker: a Qwen3 decoder over the sum of a text track and a codec track, predicting
codebook 0 of each 12.5 Hz frame."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tts_cli.checkpoint import ModelConfig
from tts_cli.model.transformer import Decoder, Linear


class TextProjection(nn.Module):
    """text_embedding width -> talker width through a biased 2-layer SiLU MLP. Always the torch
    path: it runs on prompts, outside the engine's step, and a prompt's embeddings must not depend
    on whether an engine has switched the fused kernels on (with fp16 inputs they would differ)."""

    def __init__(self, text_hidden: int, hidden: int):
        super().__init__()
        self.linear_fc1 = Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = Linear(text_hidden, hidden, bias=True)

    def forward(self, x):
        return self.linear_fc2.reference(F.silu(self.linear_fc1.reference(x)))


class Talker(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        hidden = cfg.talker.hidden_size
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)
        self.text_projection = TextProjection(cfg.text_hidden_size, hidden)
        self.codec_embedding = nn.Embedding(cfg.codec_vocab_size, hidden)
        self.decoder = Decoder(cfg.talker)
        self.codec_head = Linear(hidden, cfg.codec_vocab_size, bias=False)

    def text_track(self, text_ids: torch.Tensor) -> torch.Tensor:
        """Text-track vectors TP(id) for text token ids (fp32, as every activation)."""
        return self.text_projection(self.text_embedding(text_ids).float())

    def codec_track(self, codec_ids: torch.Tensor) -> torch.Tensor:
        return self.codec_embedding(codec_ids).float()

    def forward(self, embeds, positions, mask, caches: list | None = None):
        """Returns (final normed hidden [B, S, H], codebook-0 logits [B, S, V]); caches updated in place."""
        hidden = self.decoder(embeds, positions, mask, caches)
        return hidden, self.codec_head(hidden)
