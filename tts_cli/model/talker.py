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
    path (Linear.reference's arithmetic): it runs on prompts, outside the engine's step, and a
    prompt's embeddings must not depend on whether an engine has switched the fused kernels on
    (with fp16 inputs they would differ). Over fp16 or bf16 weights it multiplies by fp32 copies of
    them made once, not per prompt: widened per call, every prompt cost two conversions of 8 MB
    (1.7B) and their launches on `tts synth`'s engine thread, which builds the prompts' vectors
    while it waits for the GPU. The copies are remade when a weight is replaced or changed."""

    def __init__(self, text_hidden: int, hidden: int):
        super().__init__()
        self.linear_fc1 = Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = Linear(text_hidden, hidden, bias=True)
        self._widened: tuple = ((), ())   # (key, tensors): the weights and biases in the inputs' dtype

    def forward(self, x):
        w1, b1, w2, b2 = self._parameters_as(x.dtype)
        return F.linear(F.silu(F.linear(x, w1, b1)), w2, b2)

    def _parameters_as(self, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        params = (self.linear_fc1.weight, self.linear_fc1.bias, self.linear_fc2.weight, self.linear_fc2.bias)
        key = (dtype, *((p.data_ptr(), p._version) for p in params))
        if self._widened[0] != key:
            self._widened = key, tuple(p.to(dtype) for p in params)
        return self._widened[1]


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
