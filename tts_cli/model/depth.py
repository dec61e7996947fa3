"""The code predictor ("depth" transformer): codebooks 1..15 of one frame, given the talker's
hidden state and codebook 0. Its KV cache lives for one frame only."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tts_cli.checkpoint import ModelConfig
from tts_cli.model.transformer import Decoder, GrowingKV, Linear


class CodePredictor(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        talker_hidden, hidden = cfg.talker.hidden_size, cfg.code_predictor.hidden_size
        residual_groups = cfg.num_code_groups - 1
        # 1.7B: the talker is wider than the predictor, so every input is projected; 0.6B: identity.
        self.input_projection = (Linear(talker_hidden, hidden, bias=True)
                                 if talker_hidden != hidden else nn.Identity())
        # Embeddings of codebooks 1..15 are talker-wide: they also feed the next talker input.
        self.codec_embeddings = nn.ModuleList(
            nn.Embedding(cfg.code_vocab_size, talker_hidden) for _ in range(residual_groups))
        self.decoder = Decoder(cfg.code_predictor)
        self.heads = nn.ModuleList(
            Linear(hidden, cfg.code_vocab_size, bias=False) for _ in range(residual_groups))
        self.fused = False
        self.fused_tables: tuple[torch.Tensor, torch.Tensor] | None = None   # prepare_fused
        self._tables_of: tuple = ()

    @torch.no_grad()
    def prepare_fused(self) -> None:
        """Tables for the fused path (use_kernels): each codebook's embeddings already through the
        input projection, exact (float64 then fp32: one gather per position instead of a lookup,
        split, GEMM, sum and bias), and all 15 tables in one (one gather per frame embedding)."""
        weights = [emb.weight for emb in self.codec_embeddings]
        if self.fused_tables is not None and self._tables_of == self._weights_key():
            return   # unchanged weights: keep the tables that captured CUDA graphs read
        self._tables_of = self._weights_key()
        if isinstance(self.input_projection, nn.Identity):
            projected = torch.stack(weights).float()
        else:
            w, bias = self.input_projection.weight.double(), self.input_projection.bias.double()
            projected = torch.stack([F.linear(e.double(), w, bias) for e in weights]).float()
        self.fused_tables = projected, torch.cat(weights)

    def _weights_key(self) -> tuple:
        return tuple(p.data_ptr() for p in self.parameters())

    def predict_frame(self, talker_hidden: torch.Tensor, code0_embed: torch.Tensor,
                      choose: Callable[[int, torch.Tensor], torch.Tensor],
                      forced_codes: torch.Tensor | None = None, caches: list | None = None):
        """Codes 1..15 of one frame for every row.

        talker_hidden, code0_embed: [B, H]. `choose(group, logits [B, V]) -> codes [B]` is the
        sampler for codebook `group` (1..15). `forced_codes` [B, 15] replaces the choices
        (teacher forcing, for parity tests). `caches`: one StaticKV per layer with room for 16
        positions (the engine's reused buffers); by default a fresh GrowingKV each frame.
        Returns (codes [B, 15], logits [B, 15, V])."""
        b = talker_hidden.shape[0]
        device = talker_hidden.device
        caches = caches if caches is not None else [GrowingKV() for _ in self.decoder.layers]
        x = self.input_projection(torch.stack((talker_hidden, code0_embed), dim=1))
        x_rows = None   # on the fused path: the rows of the table x that are the input (Decoder.forward)
        past, codes, all_logits = 0, [], []
        for j, head in enumerate(self.heads):
            s = x.shape[1] if x_rows is None else 1
            for cache in caches:
                cache.at = past
            positions = mask = None   # the fused path derives them from the caches (a few kernels less per position)
            if not self.decoder.uses_kernels(caches):
                positions = torch.arange(past, past + s, device=device).expand(b, s)
                mask = torch.ones(s, past + s, dtype=torch.bool, device=device).tril(past)[None, None]
            hidden = self.decoder(x, positions, mask, caches, x_rows=x_rows)
            past += s
            logits = head(hidden[:, -1]).float()
            code = forced_codes[:, j] if forced_codes is not None else choose(j + 1, logits)
            codes.append(code)
            all_logits.append(logits)
            if j + 1 < len(self.heads):
                if self.fused:   # the projected table's rows, read by the decoder's first kernels
                    x, x_rows = self.fused_tables[0][j], code
                else:
                    x = self.input_projection(self.codec_embeddings[j](code).float())[:, None]
        return torch.stack(codes, dim=1), torch.stack(all_logits, dim=1)

    def frame_embedding(self, code0_embed: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Sum of the 16 codebook embeddings of a frame ([B, H]), the codec part of the next
        talker input. Stacked then summed like the official model."""
        if self.fused:   # the 15 lookups as one gather from the joined tables
            offsets = torch.arange(codes.shape[1], device=codes.device) * self.cfg.code_vocab_size
            residual = F.embedding(codes + offsets, self.fused_tables[1]).float()
            return torch.cat((code0_embed[:, None], residual), dim=1).sum(1)
        parts = [code0_embed] + [emb(codes[:, j]).float() for j, emb in enumerate(self.codec_embeddings)]
        return torch.stack(parts, dim=1).sum(1)
