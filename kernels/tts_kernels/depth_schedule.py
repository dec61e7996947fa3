"""The host-side plan of the persistent depth kernel (tts_kernels.depth_frame): which CTA runs
which task, in which order, and what each task waits for. Plain Python: tested on CPU.

A frame is the code predictor's 16 positions (the projected talker hidden state, then codebook 0,
then codebooks 1..14 as they are drawn), each through every layer, the head of the codebook it
predicts and the draw. Its work is a chain of phases; a phase is a set of independent tasks, each
one tile of one step:

  embed    rows: the position's input (given, or a table row of the code just drawn, after the
           draw from the head's partial logits); the residual stream h = input; xn = norm_1(h)
  qkv      (n tile, k split): partial sums of xn @ Wqkv.T
  attn     (kv head, row block): q/k norm and RoPE, k and v into the frame's cache, causal
           attention over the positions so far (the block's queries against all its keys in one
           tensor-core product, other rows' keys masked)
  o        (n tile, k split): partial sums of attn @ Wo.T
  norm_2   rows: h += o's partial sums (in a fixed order), xn = post-attention norm of h
  gate_up  n tile: silu(xn @ Wgate.T) * (xn @ Wup.T), full K (silu needs whole sums)
  down     (n tile, k split): partial sums of act @ Wdown.T
  norm_1   rows: h += down's partial sums, xn = the next layer's input norm (or the final norm)
  head     (n tile, k split): partial logits of the final norm of h

Every task waits on one counter in global memory until it reaches a count, then runs and
increments one counter (release; the wait is an acquire). Most tasks wait for the whole phase
before their own (a counter per phase, incremented once by each of its tasks). Three consumers
read only part of their phase before, and wait for that part alone (`Shapes.group_waits`): an
attention task the q/k/v tiles of its kv head, an o task (one K slice) the attention tasks of the
kv group its slice covers, a down task (one K slice) the gate/up tiles of its slice; their
producers increment their group's counter instead of the phase's. So a consumer need not wait
for the slowest task of the whole phase before it. Safety: each of those windows (q/k/v ->
attention -> o, gate/up -> down) lies between whole-phase waits (the norms, which wait for every
task of the phase before, and so, group by group, of the phases before that), so every task
outside the window is complete when it starts; inside it, a group's consumers read and write
only their group's columns of q/k/v, the attention output and the cache (or their own slice of
the partial sums, which the last norm has finished reading). Weight tiles are read straight from
global memory (no shared-memory ring), so there are no pages to plan.

The tasks of a phase go round-robin over the CTAs, each CTA's list in phase order. All CTAs must
be resident at once (they wait on each other): one per SM, at most the SM count.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# task kinds (the kernel dispatches on these numbers)
EMBED, QKV, ATTN, O, NORM_2, GATE_UP, DOWN, NORM_1, HEAD = range(9)
KIND_NAMES = ("embed", "qkv", "attn", "o", "norm_2", "gate_up", "down", "norm_1", "head")
# fields of one task in the table
FIELDS = ("kind", "phase", "position", "layer", "tile", "wait_counter", "wait_count", "signal_counter")
NO_WAIT = -1
POSITIONS = 16   # the talker hidden state, codebook 0, codebooks 1..14
GROUPS = 15      # codebooks drawn per frame (1..15)


# The row tiles (BLOCK_M) a launch computes: at least 16 (what a tensor-core dot needs). No 32-row
# tile: at 32 rows the 64-row tile measured faster (H200, fp16, us per frame: 2675 against 3043 for
# a 32-row tile and 2857 for the loop; docs/bench.md at 0bca9b7, 2026-12-01). A 128-row tile lost to
# the loop (3869 against 3648 us at 128 rows), so 64 rows is the most one launch takes.
ROW_TILES = (16, 64)


def row_tile(rows: int) -> int:
    """The rows one launch computes for `rows` rows: the smallest of ROW_TILES that holds them."""
    for tile in ROW_TILES:
        if rows <= tile:
            return tile
    raise ValueError(f"{rows} rows: the depth kernel runs up to {ROW_TILES[-1]} rows per launch")


@dataclass(frozen=True)
class Shapes:
    """The code predictor's shapes and the kernel's tiles. k splits divide K into whole chunks of
    the projection's block_k (fewer, larger chunks where a task's K is long: each chunk is a
    dependent load-then-multiply step); n tiles divide N."""
    hidden: int
    intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int
    rows: int            # BLOCK_M: the rows of one launch (a power of two >= 16)
    # q/k/v, o, head. H200, fp16 weights, swept on 2026-12-01 (docs/bench.md at 0bca9b7): 128-wide
    # chunks, 64-wide q/k/v tiles in two partial sums and 64-wide head tiles in four took the 64-row
    # frame from 2.77 to 2.66 ms (32 rows: 2.66 -> 2.59, 16: 2.38 -> 2.32)
    block_k: int = 128
    qkv_n: int = 64
    qkv_splits: int = 2
    o_n: int = 64
    o_splits: int = 8
    gate_up_n: int = 32
    gate_up_block_k: int = 128
    down_n: int = 64
    down_splits: int = 8
    down_block_k: int = 128
    head_n: int = 64
    head_splits: int = 4
    attn_rows: int = 4   # rows per attention task (embed and norm tasks: one row each)
    group_waits: bool = True   # attention, o and down wait for the producers of their inputs alone

    def signal_group(self, kind: int, tile: int) -> int | None:
        """The group of the next phase's readers that this task's output serves, or None where the
        next phase waits for all of this one: q/k/v tiles and attention tasks by kv head, gate/up
        tiles by the K slice of down that reads them."""
        if not self.group_waits:
            return None
        if kind == QKV and self.head_dim % self.qkv_n == 0:
            head = tile // self.qkv_splits * self.qkv_n // self.head_dim   # q heads, then k, then v heads
            return head // (self.q_heads // self.kv_heads) if head < self.q_heads else (head - self.q_heads) % self.kv_heads
        if kind == ATTN and self._o_slice_in_one_group():
            return tile % self.kv_heads
        if kind == GATE_UP and self._down_slice_in_whole_tiles():
            return tile * self.gate_up_n // (self.intermediate // self.down_splits)
        return None

    def wait_group(self, kind: int, tile: int) -> int | None:
        """The group of the phase before (its signal_group) that this task reads alone, or None."""
        if not self.group_waits:
            return None
        if kind == ATTN and self.head_dim % self.qkv_n == 0:
            return tile % self.kv_heads
        if kind == O and self._o_slice_in_one_group():
            return tile % self.o_splits * (self.q_heads * self.head_dim // self.o_splits) // self._kv_group_width()
        if kind == DOWN and self._down_slice_in_whole_tiles():
            return tile % self.down_splits
        return None

    def _kv_group_width(self) -> int:
        """Columns of the attention output that one kv head serves (its query heads')."""
        return self.q_heads // self.kv_heads * self.head_dim

    def _o_slice_in_one_group(self) -> bool:
        return self._kv_group_width() % (self.q_heads * self.head_dim // self.o_splits) == 0

    def _down_slice_in_whole_tiles(self) -> bool:
        return self.intermediate // self.down_splits % self.gate_up_n == 0

    def gemms(self) -> dict[int, tuple[int, int, int, int, int]]:
        """kind -> (N, K, n tile, k splits, block_k)."""
        qkv = (self.q_heads + 2 * self.kv_heads) * self.head_dim
        return {QKV: (qkv, self.hidden, self.qkv_n, self.qkv_splits, self.block_k),
                O: (self.hidden, self.q_heads * self.head_dim, self.o_n, self.o_splits, self.block_k),
                GATE_UP: (self.intermediate, self.hidden, self.gate_up_n, 1, self.gate_up_block_k),
                DOWN: (self.hidden, self.intermediate, self.down_n, self.down_splits, self.down_block_k),
                HEAD: (self.vocab, self.hidden, self.head_n, self.head_splits, self.block_k)}

    def check(self) -> None:
        """Raises ValueError when the tiles do not divide the shapes."""
        for kind, (n, k, n_tile, splits, block_k) in self.gemms().items():
            if n % n_tile or k % (splits * block_k):
                raise ValueError(f"{KIND_NAMES[kind]}: N {n} by tiles of {n_tile}, K {k} in {splits} splits of "
                                 f"whole {block_k}-chunks: does not divide")
        if self.rows % self.attn_rows:
            raise ValueError(f"rows {self.rows}: not a multiple of attn_rows {self.attn_rows}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"{self.q_heads} query heads do not share {self.kv_heads} kv heads evenly")

    def tasks(self, kind: int) -> int:
        if kind in (EMBED, NORM_1, NORM_2):
            return self.rows
        if kind == ATTN:
            return self.kv_heads * (self.rows // self.attn_rows)
        n, _, n_tile, splits, _ = self.gemms()[kind]
        return n // n_tile * splits


@dataclass
class Phase:
    kind: int
    position: int    # 0..15; POSITIONS for the last draw (after position 15's head)
    layer: int       # norm_1: the layer whose input norm it applies (`layers`: the final norm)
    tasks: int


@dataclass
class Schedule:
    shapes: Shapes
    ctas: int
    phases: list[Phase]
    table: list[list[tuple[int, ...]]] = field(default_factory=list)   # [cta][i] -> FIELDS
    counters: int = 0   # one per phase, then one per group of the phases whose readers wait by group

    @property
    def max_tasks(self) -> int:
        return max(len(tasks) for tasks in self.table)


def frame_phases(shapes: Shapes) -> list[Phase]:
    """The phases of one frame, in order."""
    phases = []

    def add(kind, position, layer):
        phases.append(Phase(kind, position, layer, shapes.tasks(kind)))

    for position in range(POSITIONS):
        add(EMBED, position, 0)   # for position >= 2 it first draws codebook position - 1
        for layer in range(shapes.layers):
            for kind in (QKV, ATTN, O):
                add(kind, position, layer)
            add(NORM_2, position, layer)
            add(GATE_UP, position, layer)
            add(DOWN, position, layer)
            if layer + 1 < shapes.layers:
                add(NORM_1, position, layer + 1)
        if position >= 1:   # position 0 (the talker state) predicts nothing
            add(NORM_1, position, shapes.layers)    # the final norm
            add(HEAD, position, 0)
    add(EMBED, POSITIONS, 0)   # the last draw (codebook 15); no embedding follows
    return phases


def build(shapes: Shapes, ctas: int, sms: int) -> Schedule:
    """The task table for `ctas` CTAs on a GPU of `sms` SMs. Refuses grids that cannot all be
    resident (more CTAs than SMs) and tiles that do not divide the shapes."""
    shapes.check()
    if not 1 <= ctas <= sms:
        raise ValueError(f"{ctas} CTAs on {sms} SMs: the CTAs wait on each other, so all must be resident "
                         "(at most one per SM)")
    phases = frame_phases(shapes)
    counters = len(phases)
    group_base: dict[int, int] = {}   # phase -> its first group counter, for the phases that signal by group
    signals = {}   # (phase, tile) -> the counter it increments
    for index, phase in enumerate(phases):
        groups = [shapes.signal_group(phase.kind, tile) for tile in range(phase.tasks)]
        if None in groups:
            signals.update(((index, tile), index) for tile in range(phase.tasks))
            continue
        group_base[index] = counters
        signals.update(((index, tile), counters + group) for tile, group in enumerate(groups))
        counters += max(groups) + 1
    signalled = Counter(signals.values())   # counter -> the tasks that increment it
    table: list[list[tuple[int, ...]]] = [[] for _ in range(ctas)]
    for index, phase in enumerate(phases):
        for tile in range(phase.tasks):
            wait = (NO_WAIT, 0)
            if index > 0:
                group = shapes.wait_group(phase.kind, tile)
                if (group is None) != (index - 1 not in group_base):
                    raise AssertionError(f"{KIND_NAMES[phase.kind]} and the phase before disagree on groups")
                counter = index - 1 if group is None else group_base[index - 1] + group
                wait = (counter, signalled[counter])
            table[tile % ctas].append((phase.kind, index, phase.position, phase.layer, tile, *wait,
                                       signals[index, tile]))
    return Schedule(shapes, ctas, phases, table, counters)
