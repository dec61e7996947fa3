"""The engine's prefill: the talker over the prompts of newly admitted requests, writing their keys
and values straight into their slots' static caches, and returning each prompt's last hidden
state and codebook-0 logits.

Always in tiles of the same shape, `tile_rows` prompts x COLUMNS positions (prompts right-padded,
rows padded by repeating the first prompt of the tile), one tile call per COLUMNS positions, the
later ones attending to the cached keys of the earlier ones. Two reasons:
- batch invariance: GEMM libraries choose their kernels, and so their summation order, by shape;
  a fixed shape makes a prompt's numbers independent of what else is admitted with it;
- CUDA graphs: one graph per column offset serves every admission (an eager call launches some
  400 kernels from Python: 24 ms for 8 prompts on the H200, more than the GPU work).
Padding writes stay harmless: padded positions lie beyond every prompt and are overwritten
before any query sees them; repeated rows write the same values to the same cache row.
"""
from __future__ import annotations

import torch

from tts_cli.engine.graphs import capture
from tts_cli.engine.slots import SlotState
from tts_cli.model.generate import prefill_batch

COLUMNS = 32


class Prefill:
    def __init__(self, model, state: SlotState, tile_rows: int, use_graphs: bool):
        if state.context % COLUMNS:
            raise ValueError(f"the talker context ({state.context}) must be a multiple of {COLUMNS}")
        self.talker, self.state, self.tile_rows, self.use_graphs = model.talker, state, tile_rows, use_graphs
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict, torch.Tensor]] = {}
        self.pool = None

    @torch.no_grad()
    def __call__(self, prompts: list[torch.Tensor], slots: torch.Tensor, lengths: torch.Tensor):
        """prompts: [L_i, H] each; slots, lengths [n] on the device. -> (hidden [n, H], logits [n, V] fp32)."""
        n = len(prompts)
        columns = -(-max(p.shape[0] for p in prompts) // COLUMNS) * COLUMNS
        embeds, _, positions, mask = prefill_batch(prompts, left_pad=False, columns=columns)
        hidden, logits = [], []
        for start in range(0, n, self.tile_rows):
            rows = torch.arange(start, min(start + self.tile_rows, n), device=slots.device)
            rows = torch.cat([rows, rows[:1].expand(self.tile_rows - rows.shape[0])])
            last = self._tile(embeds[rows], positions[rows], mask[rows], slots[rows], lengths[rows])
            hidden.append(last)
            logits.append(self.talker.codec_head(last).float())
        return torch.cat(hidden)[:n], torch.cat(logits)[:n]

    def _tile(self, embeds, positions, mask, slots, lengths) -> torch.Tensor:
        """Every column chunk of one tile; the hidden state at each prompt's last position."""
        last = None
        rows = torch.arange(self.tile_rows, device=slots.device)
        for chunk in range(embeds.shape[1] // COLUMNS):
            cols = slice(chunk * COLUMNS, (chunk + 1) * COLUMNS)
            inputs = {"embeds": embeds[:, cols], "positions": positions[:, cols],
                      "mask": mask[:, :, cols, :cols.stop], "slots": slots}
            hidden = self._chunk(chunk, inputs)
            column = lengths - 1 - chunk * COLUMNS
            here = ((column >= 0) & (column < COLUMNS))[:, None]
            found = hidden[rows, column.clamp(0, COLUMNS - 1)]
            last = found if last is None else torch.where(here, found, last)
        return last

    def _chunk(self, chunk: int, inputs: dict) -> torch.Tensor:
        if not self.use_graphs:
            return self._forward(chunk, **inputs)
        if chunk not in self.graphs:
            self.graphs[chunk] = self._capture(chunk, inputs)
        graph, buffers, hidden = self.graphs[chunk]
        for name, t in inputs.items():
            buffers[name].copy_(t)
        graph.replay()
        return hidden

    def _forward(self, chunk: int, embeds, positions, mask, slots) -> torch.Tensor:
        caches = [kv.for_rows(slots, at=chunk * COLUMNS) for kv in self.state.talker_kv]
        return self.talker.decoder(embeds, positions, mask, caches)

    def _capture(self, chunk: int, inputs: dict):
        buffers = {name: t.clone() for name, t in inputs.items()}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(chunk, **buffers)   # warm-up (Triton compiles, cuBLAS picks its kernels)
        torch.cuda.current_stream().wait_stream(stream)
        graph, hidden = capture(lambda: self._forward(chunk, **buffers), self.pool)
        self.pool = graph.pool()
        return graph, buffers, hidden
