"""The host-side plan of the depth-frame gate benchmark (issue 45, tools/depth_gate_bench.py): the
1.7B code predictor's 64-row frame as a chain of dependent phases, 5 per layer-step and 2 per drawn
position, each phase split into tasks that a persistent kernel of one CTA per SM walks in order.

Phases of one layer-step (t = position * 5 + layer):
  qkv      128 tasks: 32 output columns of q/k/v (rows grouped by kv head) over K 1024; the input is the
           residual stream times the norm gain in fp16 (written by the phase before), the row's
           1/rms (from published per-tile sums of squares) scales the output.
  attn     128 tasks: one kv head (its 2 q heads) for 4 rows: q/k norms, RoPE, the new k/v into the
           cache, attention over the positions so far; output fp16.
  o        128 tasks: 32 columns x 4 splits of K 2048; fp32 partials; the last of a tile's 4 tasks to
           finish sums them in a fixed order with the residual, writes the new residual, its fp16
           copy times the next norm's gain and the tile's sums of squares.
  gate/up   96 tasks: 32 gate and 32 up columns over K 1024; SiLU(gate) * up in fp16.
  down     128 tasks: like o, K 3072 in 4 splits.
Per position p >= 1 after its last layer:
  head      64 tasks: 32 logits columns of lm head p-1 over K 1024 (final norm folded in as for qkv).
  draw      64 tasks: one row each: a Gumbel-max draw from the logits / temperature, then the next
           position's input row (the code's projected embedding), its fp16 normed copy and sums of squares.

Weights are pre-tiled into [32, 256] chunks (16 KB, one TMA copy each), activations into [64, 256]
fp16 tiles. A task waits on up to 2 counters (`WAIT_*`), signals one; `grid` waits on the whole phase
before, `fine` waits only on the producers of its own input (attn on its kv head's qkv tasks, o on its
heads' attention tasks, down on its gate/up columns). Plain Python, checked on CPU
(tests/test_depth_gate_plan.py): every wait is met by exactly its target of signals from one earlier
phase, and the CTAs, each walking its list in order, all finish.
"""
from __future__ import annotations

from dataclasses import dataclass, field

ROWS, HIDDEN, HEAD_DIM, KV_HEADS, Q_HEADS, INTER, LAYERS, POSITIONS, VOCAB = 64, 1024, 128, 8, 16, 3072, 5, 16, 2048
CHUNK_ROWS, CHUNK_K = 32, 256            # a weight chunk [32, 256] fp16; an activation tile [64, 256] fp16
SPLITS = 4                               # K splits of o and down (their last arriver reduces)
ATTN_ROWS = 4                            # rows per attention task
QKV = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM   # 4096 columns, grouped per kv head: q 2g, q 2g+1, k g, v g
GROUPS = 8                               # counters per phase (fine waits)
SS_ENTRIES = HIDDEN // CHUNK_ROWS        # sums of squares published per residual update: one per 32 columns
RING = 4                                 # residual updates in flight (h, its fp16 normed copy, sums of squares)

NOP, QKVH, PARTIAL, SWIGLU, ATTN, DRAW = range(6)
KIND_NAMES = {QKVH: "qkv/head", PARTIAL: "o/down", SWIGLU: "gate/up", ATTN: "attn", DRAW: "draw", NOP: "nop"}
# task fields (int32), by position
(KIND, WAIT0, TARGET0, WAIT1, TARGET1, SIGNAL, STAMP, NCHUNK, XTILE, A, B, C, D, E, F, G, H_IN, H_OUT, HN_TILE,
 HN_COL, GAIN, SS_OUT, SEED, SPARE) = range(24)
FIELDS = 24


@dataclass
class Task:
    phase: int
    fields: list[int]
    chunks: list[int] = field(default_factory=list)   # weight chunk ids, in the order the task uses them


@dataclass
class Layout:
    """Where everything lives: fp32 buffer offsets, fp16 tile ids, parameter offsets, weight chunk bases."""
    f32: dict[str, int] = field(default_factory=dict)
    f32_size: int = 0
    tiles: dict[str, int] = field(default_factory=dict)
    tile_count: int = 0
    params: dict[str, int] = field(default_factory=dict)
    params_size: int = 0
    weights: dict[str, tuple[int, int, int]] = field(default_factory=dict)   # name: (first chunk, N, K)
    chunk_count: int = 0

    def add_f32(self, name: str, size: int) -> int:
        self.f32[name] = self.f32_size
        self.f32_size += size
        return self.f32[name]

    def add_tiles(self, name: str, count: int) -> int:
        self.tiles[name] = self.tile_count
        self.tile_count += count
        return self.tiles[name]

    def add_params(self, name: str, size: int) -> int:
        self.params[name] = self.params_size
        self.params_size += size
        return self.params[name]

    def add_weight(self, name: str, n: int, k: int) -> None:
        self.weights[name] = (self.chunk_count, n, k)
        self.chunk_count += (n // CHUNK_ROWS) * (k // CHUNK_K)

    def chunk(self, name: str, row_tile: int, k_chunk: int) -> int:
        first, _, k = self.weights[name]
        return first + row_tile * (k // CHUNK_K) + k_chunk


def layout(positions: int = POSITIONS) -> Layout:
    out = Layout()
    for slot in range(RING + 2):   # the ring, then the host-given inputs of positions 0 and 1
        out.add_f32(f"h{slot}", ROWS * HIDDEN)
        out.add_f32(f"ss{slot}", SS_ENTRIES * ROWS)
        out.add_tiles(f"hn{slot}", HIDDEN // CHUNK_K)
    for r in range(2):
        out.add_f32(f"qkv{r}", ROWS * QKV)
        out.add_f32(f"o_part{r}", SPLITS * ROWS * HIDDEN)
        out.add_f32(f"down_part{r}", SPLITS * ROWS * HIDDEN)
        out.add_tiles(f"attn{r}", Q_HEADS * HEAD_DIM // CHUNK_K)
        out.add_tiles(f"act{r}", INTER // CHUNK_K)
    out.add_f32("logits", positions * ROWS * VOCAB)
    for l in range(LAYERS):
        out.add_params(f"norm1_{l}", HIDDEN)
        out.add_params(f"norm2_{l}", HIDDEN)
        out.add_params(f"qnorm_{l}", HEAD_DIM)
        out.add_params(f"knorm_{l}", HEAD_DIM)
    out.add_params("final_norm", HIDDEN)
    out.add_params("cos", POSITIONS * HEAD_DIM)
    out.add_params("sin", POSITIONS * HEAD_DIM)
    for l in range(LAYERS):
        out.add_weight(f"qkv{l}", QKV, HIDDEN)
        out.add_weight(f"o{l}", HIDDEN, Q_HEADS * HEAD_DIM)
        out.add_weight(f"gate{l}", INTER, HIDDEN)
        out.add_weight(f"up{l}", INTER, HIDDEN)
        out.add_weight(f"down{l}", HIDDEN, INTER)
    for p in range(POSITIONS - 1):
        out.add_weight(f"head{p}", VOCAB, HIDDEN)
    return out


def cache_offset(layer: int, row: int, kv_head: int) -> int:
    """fp16 elements into the K cache [layers, rows, kv heads, positions, head dim] (V: the same after it)."""
    return ((layer * ROWS + row) * KV_HEADS + kv_head) * POSITIONS * HEAD_DIM


CACHE_SIZE = LAYERS * ROWS * KV_HEADS * POSITIONS * HEAD_DIM


@dataclass
class Plan:
    layout: Layout
    phases: list[list[Task]]
    phase_names: list[str]
    counters: int          # phase counters (GROUPS a phase), then one per o/down tile for the last arriver

    @property
    def tasks(self) -> int:
        return sum(len(p) for p in self.phases)


def build(waits: str = "grid", positions: int = POSITIONS, seed: int = 1) -> Plan:
    """The frame's phases and tasks. waits: 'grid' (each task waits on the whole phase before) or
    'fine' (on its own producers where that is fewer)."""
    assert waits in ("grid", "fine")
    lay = layout(positions)
    phases: list[list[Task]] = []
    names: list[str] = []
    stamp = 0
    n_phases_max = positions * (LAYERS * 5 + 2)
    tile_counter_base = n_phases_max * GROUPS

    def add_phase(name: str, tasks: list[Task]) -> int:
        nonlocal stamp
        index = len(phases)
        for t in tasks:
            t.phase = index
            t.fields[STAMP] = stamp
            stamp += 1
        phases.append(tasks)
        names.append(name)
        return index

    def grid_wait(task: Task, producer: int | None) -> None:
        if producer is None:
            return
        task.fields[WAIT0], task.fields[TARGET0] = producer * GROUPS, len(phases[producer])

    def new_task(kind: int, signal_phase: int, group: int = 0) -> Task:
        f = [0] * FIELDS
        f[KIND], f[WAIT0], f[WAIT1] = kind, -1, -1
        f[SIGNAL] = signal_phase * GROUPS + (group if waits == "fine" else 0)
        return Task(-1, f)

    ring_next = 0
    # residual stream state: (h offset, ss offset, hn tile base, ss entries)
    def slot(name: str) -> tuple[int, int, int]:
        return lay.f32[f"h{name}"], lay.f32[f"ss{name}"], lay.tiles[f"hn{name}"]

    def next_ring() -> str:
        nonlocal ring_next
        name = str(ring_next % RING)
        ring_next += 1
        return name

    stream, stream_entries = slot(str(RING)), 1        # position 0's input, given by the host
    last = None                                        # the phase before
    for p in range(positions):
        if p == 1:
            stream, stream_entries = slot(str(RING + 1)), 1
        for l in range(LAYERS):
            r = (p * LAYERS + l) % 2
            h_in, ss_in, hn_in = stream
            # qkv
            me = len(phases)
            tasks = []
            for j in range(QKV // CHUNK_ROWS):
                t = new_task(QKVH, me, j * CHUNK_ROWS // 512)
                grid_wait(t, last)
                f = t.fields
                f[NCHUNK], f[XTILE] = HIDDEN // CHUNK_K, hn_in
                f[A], f[B] = lay.f32[f"qkv{r}"] + j * CHUNK_ROWS, QKV
                f[C], f[D] = ss_in, stream_entries
                t.chunks = [lay.chunk(f"qkv{l}", j, c) for c in range(HIDDEN // CHUNK_K)]
                tasks.append(t)
            qkv_phase = add_phase(f"qkv p{p} l{l}", tasks)
            # attention
            me = len(phases)
            tasks = []
            for rg in range(ROWS // ATTN_ROWS):
                for g in range(KV_HEADS):
                    t = new_task(ATTN, me, g)
                    if waits == "fine":
                        t.fields[WAIT0], t.fields[TARGET0] = qkv_phase * GROUPS + g, 512 // CHUNK_ROWS
                    else:
                        grid_wait(t, qkv_phase)
                    f = t.fields
                    f[A], f[B], f[C] = lay.f32[f"qkv{r}"] + g * 512, rg * ATTN_ROWS, p
                    f[D] = cache_offset(l, 0, g)
                    f[E] = lay.tiles[f"attn{r}"] + g          # heads 2g, 2g+1 are one 256-column tile
                    f[F] = lay.params[f"qnorm_{l}"]           # knorm follows it
                    f[G] = lay.params["cos"] + p * HEAD_DIM   # sin: + POSITIONS * HEAD_DIM
                    tasks.append(t)
            attn_phase = add_phase(f"attn p{p} l{l}", tasks)
            # o + residual (the last arriver of each tile reduces)
            me = len(phases)
            out = next_ring()
            h_out, ss_out, hn_out = slot(out)
            tasks = []
            k_per_split = Q_HEADS * HEAD_DIM // SPLITS
            for j in range(HIDDEN // CHUNK_ROWS):
                for s in range(SPLITS):
                    t = new_task(PARTIAL, me)
                    if waits == "fine":   # its split's 4 heads are 2 kv heads' attention tasks
                        g0 = s * k_per_split // (2 * HEAD_DIM)
                        f = t.fields
                        f[WAIT0], f[TARGET0] = attn_phase * GROUPS + g0, ROWS // ATTN_ROWS
                        f[WAIT1], f[TARGET1] = attn_phase * GROUPS + g0 + 1, ROWS // ATTN_ROWS
                    else:
                        grid_wait(t, attn_phase)
                    _partial_fields(t, lay, j, s, k_per_split, f"attn{r}", f"o_part{r}", h_in, h_out, ss_out, hn_out,
                                    lay.params[f"norm2_{l}"], tile_counter_base + me * SS_ENTRIES + j)
                    t.chunks = [lay.chunk(f"o{l}", j, s * k_per_split // CHUNK_K + c)
                                for c in range(k_per_split // CHUNK_K)]
                    tasks.append(t)
            o_phase = add_phase(f"o p{p} l{l}", tasks)
            stream = (h_out, ss_out, hn_out)
            # gate/up
            me = len(phases)
            tasks = []
            k_down = INTER // SPLITS
            for j in range(INTER // CHUNK_ROWS):
                t = new_task(SWIGLU, me, j * CHUNK_ROWS // k_down)
                grid_wait(t, o_phase)
                f = t.fields
                f[NCHUNK], f[XTILE] = HIDDEN // CHUNK_K, hn_out
                f[A] = lay.tiles[f"act{r}"] + j * CHUNK_ROWS // CHUNK_K
                f[B] = j * CHUNK_ROWS % CHUNK_K
                f[C], f[D] = ss_out, SS_ENTRIES
                t.chunks = [x for c in range(HIDDEN // CHUNK_K)
                            for x in (lay.chunk(f"gate{l}", j, c), lay.chunk(f"up{l}", j, c))]
                tasks.append(t)
            gu_phase = add_phase(f"gate/up p{p} l{l}", tasks)
            # down + residual
            me = len(phases)
            h_in2 = h_out
            out = next_ring()
            h_out, ss_out, hn_out = slot(out)
            gain = lay.params[f"norm1_{l + 1}"] if l + 1 < LAYERS else lay.params["final_norm"]
            tasks = []
            for j in range(HIDDEN // CHUNK_ROWS):
                for s in range(SPLITS):
                    t = new_task(PARTIAL, me)
                    if waits == "fine":
                        t.fields[WAIT0], t.fields[TARGET0] = gu_phase * GROUPS + s, k_down // CHUNK_ROWS
                    else:
                        grid_wait(t, gu_phase)
                    _partial_fields(t, lay, j, s, k_down, f"act{r}", f"down_part{r}", h_in2, h_out, ss_out, hn_out,
                                    gain, tile_counter_base + me * SS_ENTRIES + j)
                    t.chunks = [lay.chunk(f"down{l}", j, s * k_down // CHUNK_K + c) for c in range(k_down // CHUNK_K)]
                    tasks.append(t)
            last = add_phase(f"down p{p} l{l}", tasks)
            stream, stream_entries = (h_out, ss_out, hn_out), SS_ENTRIES
        if p == 0:
            continue
        # head p-1 and the draw of code p
        me = len(phases)
        h_in, ss_in, hn_in = stream
        tasks = []
        for j in range(VOCAB // CHUNK_ROWS):
            t = new_task(QKVH, me)
            grid_wait(t, last)
            f = t.fields
            f[NCHUNK], f[XTILE] = HIDDEN // CHUNK_K, hn_in
            f[A], f[B] = lay.f32["logits"] + p * ROWS * VOCAB + j * CHUNK_ROWS, VOCAB
            f[C], f[D] = ss_in, SS_ENTRIES
            t.chunks = [lay.chunk(f"head{p - 1}", j, c) for c in range(HIDDEN // CHUNK_K)]
            tasks.append(t)
        head_phase = add_phase(f"head p{p}", tasks)
        me = len(phases)
        out = next_ring() if p + 1 < positions else None
        tasks = []
        for row in range(ROWS):
            t = new_task(DRAW, me)
            grid_wait(t, head_phase)
            f = t.fields
            f[A], f[B] = lay.f32["logits"] + p * ROWS * VOCAB + row * VOCAB, row
            f[C] = p * ROWS + row                               # where the code goes
            f[D] = (p - 1) * VOCAB * HIDDEN if out is not None else -1   # the next input's embedding table
            if out is not None:
                h_out, ss_out, hn_out = slot(out)
                f[H_OUT], f[HN_TILE], f[SS_OUT] = h_out + row * HIDDEN, hn_out, ss_out + row
                f[GAIN] = lay.params["norm1_0"]
            f[SEED] = seed * 1000 + p
            tasks.append(t)
        last = add_phase(f"draw p{p}", tasks)
        if out is not None:
            stream, stream_entries = slot(out), 1
    counters = tile_counter_base + len(phases) * SS_ENTRIES
    return Plan(lay, phases, names, counters)


def _partial_fields(t: Task, lay: Layout, j: int, s: int, k_per_split: int, x_tiles: str, part: str, h_in: int,
                    h_out: int, ss_out: int, hn_out: int, gain: int, tile_counter: int) -> None:
    f = t.fields
    col = j * CHUNK_ROWS
    f[NCHUNK], f[XTILE] = k_per_split // CHUNK_K, lay.tiles[x_tiles] + s * k_per_split // CHUNK_K
    f[A] = lay.f32[part] + s * ROWS * HIDDEN + col      # this split's partial
    f[C] = tile_counter
    f[E] = lay.f32[part] + col                          # split 0's partial
    f[H_IN], f[H_OUT] = h_in + col, h_out + col
    f[HN_TILE], f[HN_COL] = hn_out + col // CHUNK_K, col % CHUNK_K
    f[GAIN] = gain + col
    f[SS_OUT] = ss_out + j * ROWS


def handoff_only(plan: Plan) -> Plan:
    """The same chain of waits and signals with no work between them (the hand-off alone)."""
    phases = []
    for tasks in plan.phases:
        phases.append([Task(t.phase, [NOP if i == KIND else 0 if i == NCHUNK else v
                                              for i, v in enumerate(t.fields)]) for t in tasks])
    return Plan(plan.layout, phases, plan.phase_names, plan.counters)


def without(plan: Plan, kinds: set[int]) -> Plan:
    """The same plan with the tasks of `kinds` doing nothing but their waits and signals."""
    phases = [[Task(t.phase, [NOP if i == KIND and t.fields[KIND] in kinds else v
                                      for i, v in enumerate(t.fields)], t.chunks) for t in tasks]
              for tasks in plan.phases]
    return Plan(plan.layout, phases, plan.phase_names, plan.counters)


def weights_from_l2(plan: Plan, chunks: int) -> Plan:
    """The same plan with every weight chunk id folded into the first `chunks` (a few MB that stay in
    L2): the cost of the phases without streaming their weights from DRAM."""
    phases = [[Task(t.phase, list(t.fields), [c % chunks for c in t.chunks]) for t in tasks]
              for tasks in plan.phases]
    return Plan(plan.layout, phases, plan.phase_names, plan.counters)


def per_cta(plan: Plan, ctas: int) -> tuple[list[list[Task]], list[list[int]]]:
    """Each CTA's tasks in phase order (a phase's tasks dealt round robin, continuing where the phase
    before stopped) and the weight chunks it uses, in order."""
    lists: list[list[Task]] = [[] for _ in range(ctas)]
    dealt = 0
    for tasks in plan.phases:
        assert len(tasks) <= ctas, "a CTA would hold two tasks of one phase"
        for t in tasks:
            lists[dealt % ctas].append(t)
            dealt += 1
    return lists, [[c for t in l for c in t.chunks] for l in lists]


def check(plan: Plan, ctas: int, lists: list[list[Task]] | None = None) -> None:
    """Raise if a wait is not met by exactly its target of signals from one earlier phase, or if the
    CTAs, each walking its list (per_cta's unless given) in order with all of them resident, cannot
    all finish."""
    signals: dict[int, list[int]] = {}
    for tasks in plan.phases:
        for t in tasks:
            signals.setdefault(t.fields[SIGNAL], []).append(t.phase)
    for tasks in plan.phases:
        for t in tasks:
            for w, target in ((t.fields[WAIT0], t.fields[TARGET0]), (t.fields[WAIT1], t.fields[TARGET1])):
                if w < 0:
                    continue
                from_phases = set(signals.get(w, []))
                assert len(from_phases) == 1, f"counter {w} signalled by phases {sorted(from_phases)}"
                assert from_phases.pop() < t.phase, f"phase {t.phase} waits on a later phase"
                assert len(signals[w]) == target, f"counter {w}: {len(signals[w])} signals, target {target}"
            if t.fields[KIND] in (QKVH, PARTIAL, SWIGLU):
                per_chunk = 2 if t.fields[KIND] == SWIGLU else 1
                assert len(t.chunks) == t.fields[NCHUNK] * per_chunk, "weight chunks do not match input chunks"
    lists = lists or per_cta(plan, ctas)[0]
    count: dict[int, int] = {}
    at = [0] * ctas
    done, total = 0, plan.tasks
    while done < total:
        moved = False
        for c in range(ctas):
            while at[c] < len(lists[c]):
                f = lists[c][at[c]].fields
                if any(w >= 0 and count.get(w, 0) < target for w, target in ((f[WAIT0], f[TARGET0]),
                                                                                (f[WAIT1], f[TARGET1]))):
                    break
                count[f[SIGNAL]] = count.get(f[SIGNAL], 0) + 1
                at[c] += 1
                done += 1
                moved = True
        assert moved, f"deadlock after {done} of {total} tasks"
