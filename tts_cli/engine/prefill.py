"""The engine's prefill: the talker over the prompts of newly admitted requests, writing their keys
and values straight into their slots' static caches, and returning each prompt's last hidden
state and codebook-0 logits.

In tiles of a few fixed shapes, n prompts x `columns` positions (prompts right-padded, rows padded
by repeating the first prompt of the tile), one tile call per `columns` positions, the later ones
attending to the cached keys of the earlier ones. An admission runs tiles of the largest size, then
one of the smallest size that holds the rest (tts_cli.engine.prefill_tiles_for: on CUDA the
multiples of INVARIANT_GEMM_ROWS / columns prompts up to rows / 8). Fixed shapes for two reasons:
- batch invariance: GEMM libraries choose their kernels, and so their summation order, by shape;
  a prompt's numbers must not depend on what else is admitted with it. One shape ensures that;
  several do where each has enough GEMM rows that the library sums a row alike in all of them
  (on CUDA: tts_cli.engine.INVARIANT_GEMM_ROWS);
- CUDA graphs: one graph per size, column offset and start serves every admission (an eager call
  launches some 400 kernels from Python: 24 ms for 8 prompts on the H200, more than the GPU work).
  Each is captured when first needed (`tts bench` warms every size up before it times a run).
Padding writes stay harmless: padded positions lie beyond every prompt and are overwritten
before any query sees them; repeated rows write the same values to the same cache row. The
codebook-0 head runs on the largest tile's rows at a time whatever the tiles' sizes (its GEMM's
kernel, too, is chosen by shape).

Voice prefixes (`voice_prefix`, where the engine asks for them): a named speaker's prompts begin
with the same positions (the role, the codec control tokens: 8 for a CustomVoice speaker without
an instruct), whose keys and values depend on nothing after them. They are computed once per
prefix, as a prompt of their own in the tiles of whole prompts (so to the same numbers, bit for
bit, as in a whole prompt's tile), and copied into each admitted slot; the prompt's
tiles then start after them (`start`). The engine runs the prompts whose rest fits 16 columns in
tiles of 16-column chunks (its voice_prefill), the others in 32-column ones: of the bench's
prompts (18-30 positions, 10-22 after the prefix) two thirds take a chunk of 16 where they took one
of 32 (tools/slot_occupancy.py --prefill).
"""
from __future__ import annotations

import torch

from tts_cli.engine.graphs import capture
from tts_cli.engine.slots import SlotState
from tts_cli.model.generate import prefill_batch

COLUMNS = 32          # a tile chunk's positions
VOICE_COLUMNS = 16    # with voice prefixes


def split_tiles(n: int, sizes: tuple[int, ...]) -> list[int]:
    """The tiles (their sizes) that prefill n prompts: full tiles, then the smallest size holding the rest."""
    full, rest = divmod(n, sizes[0])
    return [sizes[0]] * full + ([min(size for size in sizes if size >= rest)] if rest else [])


class Prefill:
    def __init__(self, model, state: SlotState, sizes: tuple[int, ...], use_graphs: bool, columns: int = COLUMNS,
                 whole: Prefill | None = None):
        """sizes: the tiles' sizes in prompts, largest first; columns: the positions of a tile's chunk;
        whole: the prefill of whole prompts, which computes the voice prefixes (voice_prefix)."""
        if state.context % columns:
            raise ValueError(f"the talker context ({state.context}) must be a multiple of {columns}")
        if not sizes or list(sizes) != sorted(set(sizes), reverse=True) or sizes[-1] < 1:
            raise ValueError(f"the prefill's tile sizes must decrease from the largest, got {sizes}")
        self.talker, self.state, self.use_graphs, self.columns = model.talker, state, use_graphs, columns
        self.sizes, self.tile_rows = tuple(sizes), sizes[0]
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, dict, torch.Tensor]] = {}
        self.pool = None
        self.voices: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}   # voice_prefix's
        self.whole = whole if whole is not None else self

    @torch.no_grad()
    def __call__(self, prompts: list[torch.Tensor], slots: torch.Tensor, lengths: torch.Tensor, start: int = 0):
        """prompts: [L_i - start, H] each, the positions from `start` on (those before are in the
        slots' caches: voice_prefix); slots, lengths (L_i) [n] on the device.
        -> (hidden [n, H], logits [n, V] fp32) at each prompt's last position."""
        n = len(prompts)
        columns = -(-max(p.shape[0] for p in prompts) // self.columns) * self.columns
        embeds, _, positions, mask = prefill_batch(prompts, left_pad=False, columns=columns)
        hidden, first = [], 0
        for size in split_tiles(n, self.sizes):
            rows = _rows(first, n, size, slots.device)
            hidden.append(self._tile(embeds[rows], positions[rows] + start, mask[rows], slots[rows], lengths[rows],
                                     start))
            first += size
        hidden = torch.cat(hidden)[:n]
        logits = [self.talker.codec_head(hidden[_rows(first, n, self.tile_rows, slots.device)]).float()
                  for first in range(0, n, self.tile_rows)]
        return hidden, torch.cat(logits)[:n]

    @torch.no_grad()
    def voice_prefix(self, key: tuple, embeds: torch.Tensor, slots: torch.Tensor) -> None:
        """The keys and values of a voice prefix (`embeds` [P, H], positions 0 .. P - 1) into the
        caches of `slots`: computed by the first call with this key, copied by every call. Computed
        as a prompt of its own by the prefill of whole prompts (`whole`), into the first slot (whose
        prompt's prefill then writes what follows), so that its numbers are those of the whole
        prompt's first positions, bit for bit: one row of P positions alone would run GEMMs of other
        shapes (on CUDA gemm_rows instead of cuBLAS), which sum in another order."""
        if key not in self.voices:
            p, first = embeds.shape[0], slots[:1]
            self.whole([embeds], first, torch.full((1,), p, dtype=torch.int64, device=slots.device))
            self.voices[key] = [(kv.k[first, :, :p][0].clone(), kv.v[first, :, :p][0].clone())
                                for kv in self.state.talker_kv]
        for kv, (k, v) in zip(self.state.talker_kv, self.voices[key]):
            kv.k[slots, :, :k.shape[1]] = k
            kv.v[slots, :, :v.shape[1]] = v

    def _tile(self, embeds, positions, mask, slots, lengths, start: int) -> torch.Tensor:
        """Every column chunk of one tile; the hidden state at each prompt's last position."""
        last = None
        rows = torch.arange(embeds.shape[0], device=slots.device)
        if start:   # every position sees the voice prefix before it
            mask = torch.cat([mask.new_ones(*mask.shape[:3], start), mask], dim=3)
        for chunk in range(embeds.shape[1] // self.columns):
            cols = slice(chunk * self.columns, (chunk + 1) * self.columns)
            inputs = {"embeds": embeds[:, cols], "positions": positions[:, cols],
                      "mask": mask[:, :, cols, :start + cols.stop], "slots": slots}
            hidden = self._chunk(chunk, start, inputs)
            column = lengths - 1 - start - chunk * self.columns
            here = ((column >= 0) & (column < self.columns))[:, None]
            found = hidden[rows, column.clamp(0, self.columns - 1)]
            last = found if last is None else torch.where(here, found, last)
        return last

    def _chunk(self, chunk: int, start: int, inputs: dict) -> torch.Tensor:
        if not self.use_graphs:
            return self._forward(chunk, start, **inputs)
        key = (inputs["embeds"].shape[0], chunk, start)
        if key not in self.graphs:
            self.graphs[key] = self._capture(chunk, start, inputs)
        graph, buffers, hidden = self.graphs[key]
        for name, t in inputs.items():
            buffers[name].copy_(t)
        graph.replay()
        return hidden

    def _forward(self, chunk: int, start: int, embeds, positions, mask, slots) -> torch.Tensor:
        caches = [kv.for_rows(slots, at=start + chunk * self.columns) for kv in self.state.talker_kv]
        return self.talker.decoder(embeds, positions, mask, caches)

    def _capture(self, chunk: int, start: int, inputs: dict):
        buffers = {name: t.clone() for name, t in inputs.items()}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(chunk, start, **buffers)   # warm-up (Triton compiles, cuBLAS picks its kernels)
        torch.cuda.current_stream().wait_stream(stream)
        graph, hidden = capture(lambda: self._forward(chunk, start, **buffers), self.pool)
        self.pool = graph.pool()
        return graph, buffers, hidden


def _rows(start: int, n: int, size: int, device) -> torch.Tensor:
    """The indices start .. min(start + size, n) - 1, padded to `size` by repeating the first."""
    rows = torch.arange(start, min(start + size, n), device=device)
    return torch.cat([rows, rows[:1].expand(size - rows.shape[0])])
