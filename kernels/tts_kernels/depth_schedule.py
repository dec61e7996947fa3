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

Every task waits until all tasks of the phase before its own have signalled (a counter per
phase in global memory, incremented once by each task of that phase), then runs and signals.
Because each phase waits for the whole phase before it, every earlier phase is complete too: a
task may read anything written before its predecessor phase, and no phase writes a buffer that
a still-running task reads. Weight tiles are read straight from global memory (no shared-memory
ring), so there are no pages to plan.

The tasks of a phase go round-robin over the CTAs, each CTA's list in phase order. All CTAs must
be resident at once (they wait on each other): one per SM, at most the SM count.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# task kinds (the kernel dispatches on these numbers)
EMBED, QKV, ATTN, O, NORM_2, GATE_UP, DOWN, NORM_1, HEAD = range(9)
KIND_NAMES = ("embed", "qkv", "attn", "o", "norm_2", "gate_up", "down", "norm_1", "head")
# fields of one task in the table
FIELDS = ("kind", "phase", "position", "layer", "tile", "wait_phase", "wait_count")
NO_WAIT = -1
POSITIONS = 16   # the talker hidden state, codebook 0, codebooks 1..14
GROUPS = 15      # codebooks drawn per frame (1..15)


# The row tiles (BLOCK_M) a launch computes: at least 16 (what a tensor-core dot needs). No 32-row
# tile: at 32 rows the 64-row tile measured faster (H200, fp16, us per frame: 2675 against 3043 for
# a 32-row tile and 2857 for the loop; docs/bench.md, sixteenth session). A 128-row tile lost to the
# loop (3869 against 3648 us at 128 rows), so 64 rows is the most one launch takes.
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
    block_k: int = 64      # q/k/v, o, head (H200, 64 rows: 6.12 ms per frame against 6.28 at 128)
    qkv_n: int = 128
    qkv_splits: int = 4
    o_n: int = 64
    o_splits: int = 8
    gate_up_n: int = 32
    gate_up_block_k: int = 128
    down_n: int = 64
    down_splits: int = 8
    down_block_k: int = 128
    head_n: int = 128
    head_splits: int = 8
    attn_rows: int = 4   # rows per attention task (embed and norm tasks: one row each)

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
    table: list[list[tuple[int, ...]]] = [[] for _ in range(ctas)]
    for index, phase in enumerate(phases):
        wait = (NO_WAIT, 0) if index == 0 else (index - 1, phases[index - 1].tasks)
        for tile in range(phase.tasks):
            table[tile % ctas].append((phase.kind, index, phase.position, phase.layer, tile, *wait))
    return Schedule(shapes, ctas, phases, table)
