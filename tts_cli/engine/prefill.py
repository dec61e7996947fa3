"""The engine's prefill: the talker over the prompts of newly admitted requests, writing their keys
and values straight into their slots' static caches, and returning each prompt's last hidden
state and codebook-0 logits.

In tiles of a few fixed shapes, n prompts x COLUMNS positions (prompts right-padded, rows padded
by repeating the first prompt of the tile), one tile call per COLUMNS positions, the later ones
attending to the cached keys of the earlier ones. An admission runs tiles of the largest size, then
one of the smallest size that holds the rest (tts_cli.engine.prefill_tiles_for: on CUDA the
multiples of 8 prompts up to rows / 8). Fixed shapes for two reasons:
- batch invariance: GEMM libraries choose their kernels, and so their summation order, by shape;
  a prompt's numbers must not depend on what else is admitted with it. One shape ensures that;
  several do where each has enough GEMM rows that the library sums a row alike in all of them
  (on CUDA: tts_cli.engine.INVARIANT_GEMM_ROWS);
- CUDA graphs: one graph per size and column offset serves every admission (an eager call launches
  some 400 kernels from Python: 24 ms for 8 prompts on the H200, more than the GPU work). Each is
  captured when first needed (`tts bench` warms every size up before it times a run).
Padding writes stay harmless: padded positions lie beyond every prompt and are overwritten
before any query sees them; repeated rows write the same values to the same cache row. The
codebook-0 head runs on the largest tile's rows at a time whatever the tiles' sizes (its GEMM's
kernel, too, is chosen by shape).
"""
from __future__ import annotations

import torch

from tts_cli.engine.graphs import capture
from tts_cli.engine.slots import SlotState
from tts_cli.model.generate import prefill_batch

COLUMNS = 32


def split_tiles(n: int, sizes: tuple[int, ...]) -> list[int]:
    """The tiles (their sizes) that prefill n prompts: full tiles, then the smallest size holding the rest."""
    full, rest = divmod(n, sizes[0])
    return [sizes[0]] * full + ([min(size for size in sizes if size >= rest)] if rest else [])


class Prefill:
    def __init__(self, model, state: SlotState, sizes: tuple[int, ...], use_graphs: bool):
        """sizes: the tiles' sizes in prompts, largest first."""
        if state.context % COLUMNS:
            raise ValueError(f"the talker context ({state.context}) must be a multiple of {COLUMNS}")
        if not sizes or list(sizes) != sorted(set(sizes), reverse=True) or sizes[-1] < 1:
            raise ValueError(f"the prefill's tile sizes must decrease from the largest, got {sizes}")
        self.talker, self.state, self.use_graphs = model.talker, state, use_graphs
        self.sizes, self.tile_rows = tuple(sizes), sizes[0]
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict, torch.Tensor]] = {}
        self.pool = None

    @torch.no_grad()
    def __call__(self, prompts: list[torch.Tensor], slots: torch.Tensor, lengths: torch.Tensor):
        """prompts: [L_i, H] each; slots, lengths [n] on the device. -> (hidden [n, H], logits [n, V] fp32)."""
        n = len(prompts)
        columns = -(-max(p.shape[0] for p in prompts) // COLUMNS) * COLUMNS
        embeds, _, positions, mask = prefill_batch(prompts, left_pad=False, columns=columns)
        hidden, start = [], 0
        for size in split_tiles(n, self.sizes):
            rows = _rows(start, n, size, slots.device)
            hidden.append(self._tile(embeds[rows], positions[rows], mask[rows], slots[rows], lengths[rows]))
            start += size
        hidden = torch.cat(hidden)[:n]
        logits = [self.talker.codec_head(hidden[_rows(first, n, self.tile_rows, slots.device)]).float()
                  for first in range(0, n, self.tile_rows)]
        return hidden, torch.cat(logits)[:n]

    def _tile(self, embeds, positions, mask, slots, lengths) -> torch.Tensor:
        """Every column chunk of one tile; the hidden state at each prompt's last position."""
        last = None
        rows = torch.arange(embeds.shape[0], device=slots.device)
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
        key = (inputs["embeds"].shape[0], chunk)
        if key not in self.graphs:
            self.graphs[key] = self._capture(chunk, inputs)
        graph, buffers, hidden = self.graphs[key]
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


def _rows(start: int, n: int, size: int, device) -> torch.Tensor:
    """The indices start .. min(start + size, n) - 1, padded to `size` by repeating the first."""
    rows = torch.arange(start, min(start + size, n), device=device)
    return torch.cat([rows, rows[:1].expand(size - rows.shape[0])])
