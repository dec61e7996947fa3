"""The engine's prefill: the talker over the prompts of newly admitted requests, writing their keys
and values straight into their slots' static caches, and returning each prompt's last hidden
state and codebook-0 logits.

Packed tiles. A prompt (from `start`: 0, or the end of its voice prefix) is cut into chunks of at
most COLUMNS positions; chunk k of every prompt that has one belongs to round k, whose chunks attend
to the keys the earlier rounds cached (most prompts have one chunk). A round's chunks lie back to
back in tiles of a few fixed token counts (`sizes`, largest first): full tiles of the largest size,
then the smallest size that holds the rest, each holding at most size // MIN_CHUNK_TOKENS chunks.
In a tile every GEMM, norm and residual add runs over all its tokens as rows; the attention kernel
takes each chunk as a row of its own: its tokens, its slot, its first position
(StaticKV.for_segments). The tile's unused tokens are zeros; their outputs are dropped. On the
bench's admissions at 64-512 slots that is 0.60-0.75x the token rows of the tiles of whole prompts
right-padded to 32 (or 16) positions that it replaced (tools/slot_occupancy.py --prefill, 2026-12-06).

Fixed token counts for two reasons:
- batch invariance: GEMM libraries choose their kernels, and so their summation order, by shape;
  a prompt's numbers must not depend on what else is admitted with it. One shape ensures that;
  several do where each has enough GEMM rows that the library sums a row alike in all of them
  (on CUDA: multiples of tts_cli.engine.INVARIANT_GEMM_ROWS). A token's attention reads only its own
  chunk's slot, so its place in the tile changes nothing either;
- CUDA graphs: one graph per size serves every admission and round (slots, positions and chunks are
  inputs). Each is captured when first needed (`tts bench` warms every size up before it times a
  run). The torch path's attention walks the chunks on the host: it runs without graphs.
The codebook-0 head runs on `head_rows` prompts at a time (its GEMM's kernel, too, is chosen by shape).

Voice prefixes (`voice_prefix`, where the engine asks for them): a voice's prompts begin with the
same positions (the role, the codec control tokens: 8 for a CustomVoice speaker without an instruct;
a cloned voice's x-vector among them, and its ICL transcript after them: Prompt.voice_prefix), whose
keys and values depend on nothing after them. They are computed once per
prefix, as a prompt of its own (so to the numbers of a whole prompt's first positions, bit for bit),
kept (VOICES_KEPT) and copied into each admitted slot; the prompt's chunks then start after them.
(The engine takes this route where two prompts of an admission, or a kept prefix, share the voice.)
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from tts_cli.engine import PREFILL_COLUMNS as COLUMNS
from tts_cli.engine.graphs import capture
from tts_cli.engine.slots import SlotState
from tts_cli.model.host import to_device

MIN_CHUNK_TOKENS = 8    # a tile of T tokens holds at most T / this many chunks (the attention kernel's rows)
# Voice prefixes kept, the least recently used evicted (a corpus may clone a voice per row): 112 KiB a
# position at the 1.7B shapes (fp16), 8-50 positions each, so at most ~180 MB.
VOICES_KEPT = 32


@dataclass
class Chunk:
    prompt: int     # its prompt's index in the call
    first: int      # its first position in the prompt's given rows
    count: int      # its positions
    last: bool      # the prompt's last chunk


def chunk_rounds(lengths: list[int]) -> list[list[Chunk]]:
    """Each round's chunks (module doc) of prompts of these lengths (the rows given, after `start`)."""
    rounds = []
    for k in range(max(-(-n // COLUMNS) for n in lengths)):
        first = k * COLUMNS
        rounds.append([Chunk(i, first, min(COLUMNS, n - first), n <= first + COLUMNS)
                       for i, n in enumerate(lengths) if n > first])
    return rounds


def pack(chunks: list[Chunk], sizes: tuple[int, ...]) -> list[tuple[int, list[Chunk]]]:
    """The round's chunks in tiles (size, its chunks): full tiles of the largest size, each closed when
    the next chunk would pass its tokens or chunks, then the smallest size that holds the rest."""
    tiles, tile, tokens = [], [], 0
    for chunk in chunks:
        if tile and (tokens + chunk.count > sizes[0] or len(tile) == sizes[0] // MIN_CHUNK_TOKENS):
            tiles.append((sizes[0], tile))
            tile, tokens = [], 0
        tile.append(chunk)
        tokens += chunk.count
    size = min(s for s in sizes if s >= tokens and s // MIN_CHUNK_TOKENS >= len(tile))
    return tiles + [(size, tile)]


class Prefill:
    def __init__(self, model, state: SlotState, sizes: tuple[int, ...], head_rows: int, use_graphs: bool):
        """sizes: the tiles' token counts, largest first; head_rows: the prompts of one codebook-0
        head call; use_graphs: CUDA graphs, where the talker runs its kernels (asked at each tile: the
        model's kernels may be switched by a later engine)."""
        if not sizes or list(sizes) != sorted(set(sizes), reverse=True) or sizes[-1] < COLUMNS:
            raise ValueError(f"the prefill's tile sizes must decrease from the largest and hold a chunk of "
                             f"{COLUMNS} positions, got {sizes}")
        self.talker, self.state, self.sizes, self.head_rows = model.talker, state, tuple(sizes), head_rows
        self.use_graphs = use_graphs
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict, torch.Tensor]] = {}
        self.pool = None
        self.voices: OrderedDict[tuple, torch.Tensor] = OrderedDict()   # voice_prefix's, every layer's

    @torch.no_grad()
    def __call__(self, prompts: list[torch.Tensor], slots: list[int], starts: list[int]):
        """prompts: [L_i - start_i, H] each, the positions from starts[i] on (those before are in the
        slots' caches: voice_prefix); slots: each prompt's.
        -> (hidden [n, H], logits [n, V] fp32) at each prompt's last position."""
        if not prompts or min(p.shape[0] for p in prompts) == 0:
            raise ValueError("the prefill takes one or more prompts of at least one position from their start, got "
                             f"{[p.shape[0] for p in prompts]}")
        n, device = len(prompts), prompts[0].device
        hidden = prompts[0].new_empty(n + 1, self.talker.decoder.cfg.hidden_size, dtype=torch.float32)  # + scratch
        for chunks in chunk_rounds([p.shape[0] for p in prompts]):
            for size, tile in pack(chunks, self.sizes):
                inputs = self._inputs(size, tile, prompts, slots, starts)
                picks, owners = inputs["table"][4:]
                hidden.index_copy_(0, owners, self._tile(size, inputs)[picks])
        logits = [self.talker.codec_head(hidden[_rows(first, n, self.head_rows, device)]).float()
                  for first in range(0, n, self.head_rows)]
        return hidden[:n], torch.cat(logits)[:n]

    @torch.no_grad()
    def voice_prefix(self, key: tuple, embeds: torch.Tensor, slots: list[int]) -> None:
        """The keys and values of a voice prefix (`embeds` [P, H], positions 0 .. P - 1) into the
        caches of `slots`: computed by the first call with this key, as a prompt of its own into the
        first slot (whose prompt's prefill then writes what follows), copied by every call."""
        cache = self.state.talker_cache   # [2, layers, slots, kv heads, positions, head_dim]
        if key not in self.voices:
            p, first = embeds.shape[0], slots[0]
            self([embeds], [first], [0])
            self.voices[key] = cache[:, :, first, :, :p].clone()
            if len(self.voices) > VOICES_KEPT:
                self.voices.popitem(last=False)
        self.voices.move_to_end(key)
        prefix = self.voices[key]
        cache[:, :, to_device(slots, embeds.device), :, :prefix.shape[3]] = prefix[:, :, None]   # one copy

    @torch.no_grad()
    def warm_up(self, embeds: torch.Tensor, slot: int) -> None:
        """Runs a tile of every size whose graph is not yet captured (without graphs: every size), each
        over one chunk of `embeds` into `slot`'s cache (an idle slot's: its keys are overwritten before
        they are read), so that no later admission captures a graph or compiles a kernel."""
        chunk = Chunk(0, 0, min(COLUMNS, embeds.shape[0]), True)
        for size in self.sizes:
            if size not in self.graphs:
                self._tile(size, self._inputs(size, [chunk], [embeds], [slot], [0]))

    def _inputs(self, size: int, tile: list[Chunk], prompts, slots, starts) -> dict:
        """A tile's tensors: its tokens' vectors and positions, each chunk's slot, first position, first
        token and count (unused chunk rows: nothing), and where each prompt ending here finds its last
        hidden state (table rows 4 and 5: the token; the prompt, unused ones the scratch row n); `host`:
        the table's first four rows as lists, which the torch path's attention reads."""
        rows = size // MIN_CHUNK_TOKENS
        table = [[0] * rows for _ in range(4)] + [[0] * rows, [len(prompts)] * rows]
        positions, token = [0] * size, 0
        for j, c in enumerate(tile):
            at = starts[c.prompt] + c.first
            for field, value in enumerate((slots[c.prompt], at, token, c.count)):
                table[field][j] = value
            positions[token:token + c.count] = range(at, at + c.count)
            if c.last:
                table[4][j], table[5][j] = token + c.count - 1, c.prompt
            token += c.count
        parts = [prompts[c.prompt][c.first:c.first + c.count] for c in tile]
        embeds = torch.cat(parts + [parts[0].new_zeros(size - token, parts[0].shape[1])])
        on_device = to_device([v for column in table for v in column] + positions, embeds.device)   # one copy
        return {"embeds": embeds, "table": on_device[:6 * rows].view(6, rows), "positions": on_device[6 * rows:],
                "host": table[:4]}

    def _tile(self, size: int, inputs: dict) -> torch.Tensor:
        if not (self.use_graphs and self.talker.decoder.fused):
            return self._forward(**inputs)
        if size not in self.graphs:
            self.graphs[size] = self._capture(inputs)
        graph, buffers, hidden = self.graphs[size]
        for name, t in buffers.items():
            t.copy_(inputs[name])
        graph.replay()
        return hidden

    def _forward(self, embeds, positions, table, host=None) -> torch.Tensor:
        """The talker over one tile -> hidden [size, H]."""
        slots, at, first, count = table[:4]
        caches = [kv.for_segments(slots, at, first, count, COLUMNS, host) for kv in self.state.talker_kv]
        return self.talker.decoder(embeds[None], positions[None], None, caches)[0]

    def _capture(self, inputs: dict):
        buffers = {name: t.clone() for name, t in inputs.items() if name != "host"}   # the kernels' path
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(**buffers)   # warm-up (Triton compiles, cuBLAS picks its kernels)
        torch.cuda.current_stream().wait_stream(stream)
        graph, hidden = capture(lambda: self._forward(**buffers), self.pool)
        self.pool = graph.pool()
        return graph, buffers, hidden


def _rows(start: int, n: int, size: int, device) -> torch.Tensor:
    """The indices start .. min(start + size, n) - 1, padded to `size` by repeating the first."""
    rows = torch.arange(start, min(start + size, n), device=device)
    return torch.cat([rows, rows[:1].expand(size - rows.shape[0])])
