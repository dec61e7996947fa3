"""The gate of issue 45: how long does the 1.7B code predictor's 64-row depth frame take as a chain of
5 dependent phases per layer-step (qkv, attention, o, gate/up, down) plus 2 per drawn position (head,
draw), each phase doing its real work? 430 phases per 16-position frame, against 591 in
kernels/tts_kernels/depth_frame.py. The plan (phases, tasks, buffers) is
kernels/tts_kernels/depth_gate_plan.py.

One Gluon launch of one CTA per SM walks the plan. Every GEMM task streams its own weight chunks
([32, 256] fp16, 16 KB, by TMA; 210 MB of weights a frame, distinct per layer and lm head, so they come
from DRAM) through a ring of NW chunk slots in shared memory, brings its [64, K-chunk] fp16 input in by
TMA after its wait, multiplies with wgmma (M 64, N 32) and writes its output: q/k/v and logits scaled by
each row's 1/rms (sums of squares published by the residual's writers: the norms folded into the
consumers), SiLU(gate) * up in fp16, or fp32 partials of o / down that the last of a tile's 4 split
tasks sums in a fixed order with the residual (deterministic), writing the new residual, its fp16 copy
times the next norm's gain and the tile's sums of squares. Attention tasks (one kv head, 4 rows) do the
q/k norms, RoPE, the cache append and attention over the positions so far; draw tasks (one row) a
Gumbel-max draw at temperature 0.9 over the logits (no top-k: lighter than the engine's sampler) and
the next position's input from the code's embedding table.

Variants (one compiled kernel; each a plan or a launch argument), timed alternated:
  grid-prefetch   every task waits on the whole phase before; its weight chunks are in flight before
                  the wait (the ring is topped up whenever a slot frees, up to NW chunks ahead)
  grid-after      the same, weights copied only after the wait
  fine-prefetch   tasks wait only on their own producers where that is fewer (attn, o, down)
  fine-after
  fine-l2         fine-prefetch with all weights folded into 2 MB (L2): the cost without DRAM streaming
  handoff         the same 430 waits and signals with no work between them
Each launch also records, per task, the global timer before the wait, after it and after the signal
(a second launch of each variant); the breakdown per phase kind (hand-off: the end of the phase
before to the median task's start; body: a task's median start to signal) is printed.

Numerics: the logits of every position against a torch reference of the real model (norms before
the GEMMs, fp16 GEMM inputs, fp32 elsewhere) given the kernel's own codes, as a fraction of the
largest logit; the kernel's codes against the same Gumbel-max draw in torch from the kernel's
logits; two launches bit-identical.

    python tools/depth_gate_bench.py --compile         # sm_90 without a GPU: registers, shared memory
    PYTHONPATH=.:kernels python tools/depth_gate_bench.py [--replays 20] [--rounds 2] [--out DIR]   # the H200

`--compile` wants the device's Triton (3.6) first on PYTHONPATH (tools/sm90_compile.py: DEVICE_TRITON).
`--skip attn,draw` turns those tasks into waits and signals only. The H200's output of 2026-12-03 (at
`0dace44`, `--nw 5,6 --replays 20 --rounds 3`): bench/results/depth-gate-430-phases-h200-2026-12-03.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels"))
from tts_kernels import depth_gate_plan as P  # noqa: E402

NW = 5                     # weight chunk slots (16 KB each) next to 4 input tiles (32 KB each)
# the kernel's constants (Triton reads only constexpr globals)
ATTN_ROWS, CACHE_SIZE, CHUNK_K, CHUNK_ROWS, FIELDS = map(gl.constexpr, (P.ATTN_ROWS, P.CACHE_SIZE, P.CHUNK_K,
                                                                      P.CHUNK_ROWS, P.FIELDS))
HEAD_DIM, HIDDEN, KV_HEADS, POSITIONS, ROWS = map(gl.constexpr, (P.HEAD_DIM, P.HIDDEN, P.KV_HEADS, P.POSITIONS, P.ROWS))
SPLITS, SS_ENTRIES, VOCAB, QKV = map(gl.constexpr, (P.SPLITS, P.SS_ENTRIES, P.VOCAB, P.QKV))
MAX_INPUT_CHUNKS = gl.constexpr(4)
EPS = gl.constexpr(1e-6)
TEMPERATURE = gl.constexpr(0.9)
SPIN_LIMIT = gl.constexpr(1 << 21)   # polls before a wait gives up and flags the launch as failed (no hang)
DEVICE = "cuda"   # run_on_gpu's device (a dry run of the host code may set "cpu")
VARIANTS = ["grid-prefetch", "grid-after", "fine-prefetch", "fine-after", "fine-l2", "handoff"]


@gluon.jit
def _now():
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _wait(counters_ptr, index, target, dead):
    """Spin until counter `index` reaches `target`; returns 1 (and stops waiting from then on) when
    it never does."""
    if (index >= 0) & (dead == 0):
        seen = gl.atomic_add(counters_ptr + index, 0, sem="acquire", scope="gpu")
        spins = 0
        while (seen < target) & (spins < SPIN_LIMIT):
            seen = gl.atomic_add(counters_ptr + index, 0, sem="acquire", scope="gpu")
            spins += 1
        if seen < target:
            dead = 1
    return dead


@gluon.jit
def _top_up(w_desc, w_smem, w_bars, chunk_list, issued, used, end, NW: gl.constexpr):
    """Copy weight chunks into free ring slots, at most NW ahead of the last one used, up to `end`."""
    limit = gl.minimum(used + NW, end)
    while issued < limit:
        slot = issued % NW
        mbarrier.expect(w_bars.index(slot), w_desc.block_type.nbytes)
        chunk = gl.load(chunk_list + issued)
        tma.async_copy_global_to_shared(w_desc, [chunk * CHUNK_ROWS, 0], w_bars.index(slot), w_smem.index(slot))
        issued += 1
    return issued


@gluon.jit
def _attention(f32, vectors, cache, xt, qkv, row0, pos, cache_at, attn_tile, qnorm, cos_at):
    """One kv head's 2 q heads for ATTN_ROWS rows: q/k norms, RoPE, the new k/v into the cache,
    softmax attention over positions 0..pos, fp16 output into its activation tile."""
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [4, 1, 1], [2, 1, 0])
    L2: gl.constexpr = gl.SliceLayout(1, L3)          # [rows, head dim]
    S2: gl.constexpr = gl.SliceLayout(2, L3)          # [rows, positions]
    r = gl.arange(0, ATTN_ROWS, layout=gl.SliceLayout(1, L2))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, L2))
    d_rot = (d + HEAD_DIM // 2) % HEAD_DIM
    sign = gl.expand_dims(gl.where(d < HEAD_DIM // 2, -1.0, 1.0), 0)
    rows2 = gl.expand_dims(row0 + r, 1)
    at = qkv + rows2 * QKV + gl.expand_dims(d, 0)
    at_rot = qkv + rows2 * QKV + gl.expand_dims(d_rot, 0)
    cos = gl.expand_dims(gl.load(vectors + cos_at + d), 0)
    sin = gl.expand_dims(gl.load(vectors + cos_at + POSITIONS * HEAD_DIM + d), 0)
    kg = gl.expand_dims(gl.load(vectors + qnorm + HEAD_DIM + d), 0)
    kg_rot = gl.expand_dims(gl.load(vectors + qnorm + HEAD_DIM + d_rot), 0)
    k = gl.load(f32 + at + 2 * HEAD_DIM, cache_modifier=".cg")
    k_rot = gl.load(f32 + at_rot + 2 * HEAD_DIM, cache_modifier=".cg")
    v = gl.load(f32 + at + 3 * HEAD_DIM, cache_modifier=".cg")
    rk = gl.expand_dims(gl.rsqrt(gl.sum(k * k, axis=1) / HEAD_DIM + EPS), 1)
    k = (k * rk * kg * cos + sign * k_rot * rk * kg_rot * sin).to(gl.float16)
    v = v.to(gl.float16)
    row_stride: gl.constexpr = KV_HEADS * POSITIONS * HEAD_DIM
    new_at = cache_at + rows2 * row_stride + pos * HEAD_DIM + gl.expand_dims(d, 0)
    gl.store(cache + new_at, k)
    gl.store(cache + CACHE_SIZE + new_at, v)
    # the cache so far, with the new position from registers (no write-then-read)
    r3 = gl.expand_dims(gl.expand_dims(gl.arange(0, ATTN_ROWS, layout=gl.SliceLayout(1, S2)), 1), 2)
    j2 = gl.expand_dims(gl.arange(0, POSITIONS, layout=gl.SliceLayout(0, S2)), 0)
    j3 = gl.expand_dims(j2, 2)
    d3 = gl.expand_dims(gl.expand_dims(d, 0), 1)
    old_at = cache_at + (row0 + r3) * row_stride + j3 * HEAD_DIM + d3
    before = j3 < pos
    keys = gl.load(cache + old_at, mask=before, other=0.0, cache_modifier=".cg").to(gl.float32)
    values = gl.load(cache + CACHE_SIZE + old_at, mask=before, other=0.0, cache_modifier=".cg").to(gl.float32)
    keys = gl.where(j3 == pos, gl.expand_dims(k.to(gl.float32), 1), keys)
    values = gl.where(j3 == pos, gl.expand_dims(v.to(gl.float32), 1), values)
    qg = gl.expand_dims(gl.load(vectors + qnorm + d), 0)
    qg_rot = gl.expand_dims(gl.load(vectors + qnorm + d_rot), 0)
    out_rows = gl.expand_dims((attn_tile * ROWS + row0 + r) * CHUNK_K, 1)
    for h in gl.static_range(2):
        q = gl.load(f32 + at + h * HEAD_DIM, cache_modifier=".cg")
        q_rot = gl.load(f32 + at_rot + h * HEAD_DIM, cache_modifier=".cg")
        rq = gl.expand_dims(gl.rsqrt(gl.sum(q * q, axis=1) / HEAD_DIM + EPS), 1)
        q = (q * rq * qg * cos + sign * q_rot * rq * qg_rot * sin) * (1.0 / math.sqrt(HEAD_DIM))
        scores = gl.sum(gl.expand_dims(q, 1) * keys, axis=2)
        scores = gl.where(j2 <= pos, scores, float("-inf"))
        weights = gl.exp(scores - gl.expand_dims(gl.max(scores, axis=1), 1))
        weights = weights / gl.expand_dims(gl.sum(weights, axis=1), 1)
        out = gl.sum(gl.expand_dims(weights, 2) * values, axis=1)
        gl.store(xt + out_rows + h * HEAD_DIM + gl.expand_dims(d, 0), out.to(gl.float16))


@gluon.jit
def _draw(f32, vectors, xt, emb, codes, logits_at, row, code_at, emb_at, h_out, hn_tile, ss_out, gain, seed):
    """One row: code = argmax(logits / T + Gumbel noise); then the next position's input row: the
    code's embedding, its fp16 copy times the gain, its sum of squares."""
    V1: gl.constexpr = gl.BlockedLayout([VOCAB // 128], [32], [4], [0])
    i = gl.arange(0, VOCAB, layout=V1)
    logits = gl.load(f32 + logits_at + i, cache_modifier=".cg")
    x = (row * VOCAB + i + seed * 7919).to(gl.uint32)
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x2C1B3C6D
    x = x ^ (x >> 16)
    u = ((x >> 8).to(gl.float32) + 0.5) * (1.0 / 16777216.0)
    score = logits * (1.0 / TEMPERATURE) - gl.log(-gl.log(u))
    code = gl.min(gl.where(score == gl.max(score, axis=0), i, VOCAB), axis=0)   # the first best
    gl.store(codes + code_at, code)
    if emb_at >= 0:
        H1: gl.constexpr = gl.BlockedLayout([HIDDEN // 128], [32], [4], [0])
        c = gl.arange(0, HIDDEN, layout=H1)
        e = gl.load(emb + emb_at + code.to(gl.int64) * HIDDEN + c).to(gl.float32)
        gl.store(f32 + h_out + c, e)
        g = gl.load(vectors + gain + c)
        gl.store(xt + ((hn_tile + c // CHUNK_K) * ROWS + row) * CHUNK_K + c % CHUNK_K, (e * g).to(gl.float16))
        gl.store(f32 + ss_out, gl.sum(e * e, axis=0))


@gluon.jit
def _finalize(f32, vectors, xt, part0, h_in, h_out, hn_tile, hn_col, gain, ss_out):
    """The last split task of an o / down tile: residual + the SPLITS partials in a fixed order; the new
    residual, its fp16 copy times the gain, the tile's sums of squares per row."""
    P3: gl.constexpr = gl.BlockedLayout([SPLITS, 1, 2], [1, 2, 16], [1, 4, 1], [2, 1, 0])
    T2: gl.constexpr = gl.SliceLayout(0, P3)
    s = gl.arange(0, SPLITS, layout=gl.SliceLayout(1, gl.SliceLayout(2, P3)))
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, T2))
    c = gl.arange(0, CHUNK_ROWS, layout=gl.SliceLayout(0, T2))
    rc = gl.expand_dims(r, 1) * HIDDEN + gl.expand_dims(c, 0)
    parts = gl.load(f32 + part0 + gl.expand_dims(gl.expand_dims(s, 1), 2) * (ROWS * HIDDEN) + gl.expand_dims(rc, 0),
                    cache_modifier=".cg")
    h = gl.load(f32 + h_in + rc, cache_modifier=".cg") + gl.sum(parts, axis=0)
    gl.store(f32 + h_out + rc, h)
    g = gl.expand_dims(gl.load(vectors + gain + c), 0)
    gl.store(xt + (hn_tile * ROWS + gl.expand_dims(r, 1)) * CHUNK_K + hn_col + gl.expand_dims(c, 0),
             (h * g).to(gl.float16))
    gl.store(f32 + ss_out + r, gl.sum(h * h, axis=1))


@gluon.jit
def _row_rinv(f32, ss_in, ss_count, layout: gl.constexpr):
    """1 / rms of each row from the published sums of squares (summed in a fixed order)."""
    SS: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [4, 1], [1, 0])
    e = gl.arange(0, SS_ENTRIES, layout=gl.SliceLayout(1, SS))
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(0, SS))
    ss = gl.load(f32 + ss_in + gl.expand_dims(e, 1) * ROWS + gl.expand_dims(r, 0),
                 mask=gl.expand_dims(e, 1) < ss_count, other=0.0, cache_modifier=".cg")
    rinv = gl.rsqrt(gl.sum(ss, axis=0) / HIDDEN + EPS)
    return gl.convert_layout(rinv, layout)


@gluon.jit(do_not_specialize=["prefetch", "stamps"])
def depth_gate(table_ptr, task_counts, chunk_lists, chunk_counts, counters_ptr, failed_ptr, stamps_ptr,
               x_desc, w_desc, f32, xt, vectors, cache, emb, codes, prefetch, stamps,
               MAX_TASKS: gl.constexpr, MAX_CHUNKS: gl.constexpr, NW: gl.constexpr, num_warps: gl.constexpr):
    cta = gl.program_id(0)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [MAX_INPUT_CHUNKS] + x_desc.block_shape, x_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [NW] + w_desc.block_shape, w_desc.layout)
    x_bars = gl.allocate_shared_memory(gl.int64, [MAX_INPUT_CHUNKS, 1], mbarrier.MBarrierLayout())
    w_bars = gl.allocate_shared_memory(gl.int64, [NW, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(MAX_INPUT_CHUNKS):
        mbarrier.init(x_bars.index(i), count=1)
    for i in gl.static_range(NW):
        mbarrier.init(w_bars.index(i), count=1)
    fence_async_shared()
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, CHUNK_ROWS, 16])
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, CHUNK_ROWS, layout=gl.SliceLayout(0, acc_layout))
    my_chunks = chunk_lists + cta * MAX_CHUNKS
    n_chunks = gl.load(chunk_counts + cta)
    n_tasks = gl.load(task_counts + cta)
    issued = 0      # weight chunks whose copy was issued
    used = 0        # weight chunks multiplied (their slot free again)
    x_phase = 0     # bit c: the phase of input slot c's barrier
    dead = 0
    for t in range(n_tasks):
        task = table_ptr + (cta * MAX_TASKS + t) * FIELDS
        # every field before the wait (the acquire would order loads after it behind it)
        kind = gl.load(task + 0)
        wait0, target0, wait1, target1 = gl.load(task + 1), gl.load(task + 2), gl.load(task + 3), gl.load(task + 4)
        signal, stamp_at, n_in, x_tile = gl.load(task + 5), gl.load(task + 6), gl.load(task + 7), gl.load(task + 8)
        a, b, c, d = gl.load(task + 9), gl.load(task + 10), gl.load(task + 11), gl.load(task + 12)
        e, f, g, h_in = gl.load(task + 13), gl.load(task + 14), gl.load(task + 15), gl.load(task + 16)
        h_out, hn_tile, hn_col, gain = gl.load(task + 17), gl.load(task + 18), gl.load(task + 19), gl.load(task + 20)
        ss_out, seed = gl.load(task + 21), gl.load(task + 22)
        task_end = used + n_in * (1 + (kind == 3).to(gl.int32))
        if prefetch != 0:
            issued = _top_up(w_desc, w_smem, w_bars, my_chunks, issued, used, n_chunks, NW)
        t0 = _now()
        dead = _wait(counters_ptr, wait0, target0, dead)
        dead = _wait(counters_ptr, wait1, target1, dead)
        t1 = _now()
        # the producers' generic stores are read below by TMA (the async proxy)
        gl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
        if (kind == 1) | (kind == 2) | (kind == 3):
            for ci in range(n_in):
                mbarrier.expect(x_bars.index(ci), x_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(x_desc, [(x_tile + ci) * ROWS, 0], x_bars.index(ci), x_smem.index(ci))
            end = task_end
            if prefetch != 0:
                end = n_chunks
            issued = _top_up(w_desc, w_smem, w_bars, my_chunks, issued, used, end, NW)
            rinv = gl.full([ROWS], 1.0, gl.float32, layout=gl.SliceLayout(1, acc_layout))
            if kind != 2:   # the rows' 1 / rms, read while the input lands
                rinv = _row_rinv(f32, c, d, gl.SliceLayout(1, acc_layout))
            rinv = gl.expand_dims(rinv, 1)
            acc = gl.zeros([ROWS, CHUNK_ROWS], gl.float32, layout=acc_layout)
            acc2 = gl.zeros([ROWS, CHUNK_ROWS], gl.float32, layout=acc_layout)
            for ci in range(n_in):
                mbarrier.wait(x_bars.index(ci), phase=(x_phase >> ci) & 1)
                slot = used % NW
                mbarrier.wait(w_bars.index(slot), phase=(used // NW) & 1)
                acc = warpgroup_mma(x_smem.index(ci), w_smem.index(slot).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
                used += 1
                if kind == 3:
                    slot = used % NW
                    mbarrier.wait(w_bars.index(slot), phase=(used // NW) & 1)
                    acc2 = warpgroup_mma(x_smem.index(ci), w_smem.index(slot).permute((1, 0)), acc2, is_async=True)
                    acc2 = warpgroup_mma_wait(num_outstanding=0, deps=[acc2])
                    used += 1
                issued = _top_up(w_desc, w_smem, w_bars, my_chunks, issued, used, end, NW)
            x_phase = x_phase ^ ((1 << n_in) - 1)
            if kind == 1:   # q/k/v or logits, times the row's 1 / rms
                gl.store(f32 + a + gl.expand_dims(rows, 1) * b + gl.expand_dims(cols, 0), acc * rinv)
            elif kind == 3:   # SiLU(gate) * up, both times the row's 1 / rms
                gate = acc * rinv
                act = gate / (1.0 + gl.exp(-gate)) * (acc2 * rinv)
                gl.store(xt + (a * ROWS + gl.expand_dims(rows, 1)) * CHUNK_K + b + gl.expand_dims(cols, 0),
                         act.to(gl.float16))
            else:   # a split's partial; the tile's last split reduces
                gl.store(f32 + a + gl.expand_dims(rows, 1) * HIDDEN + gl.expand_dims(cols, 0), acc)
                gl.thread_barrier()
                arrived = gl.atomic_add(counters_ptr + c, 1, sem="acq_rel", scope="gpu")
                if arrived == SPLITS - 1:
                    _finalize(f32, vectors, xt, e, h_in, h_out, hn_tile, hn_col, gain, ss_out)
        elif kind == 4:
            _attention(f32, vectors, cache, xt, a, b, c, d, e, f, g)
        elif kind == 5:
            _draw(f32, vectors, xt, emb, codes, a, b, c, d, h_out, hn_tile, ss_out, gain, seed)
        gl.thread_barrier()
        gl.atomic_add(counters_ptr + signal, 1, sem="release", scope="gpu")
        if stamps != 0:
            at = stamps_ptr + stamp_at * 3
            gl.store(at, t0)
            gl.store(at + 1, t1)
            gl.store(at + 2, _now())
    if dead != 0:
        gl.atomic_add(failed_ptr, 1)
    for i in gl.static_range(MAX_INPUT_CHUNKS):
        mbarrier.invalidate(x_bars.index(i))
    for i in gl.static_range(NW):
        mbarrier.invalidate(w_bars.index(i))


def shared_layout(block: list[int]):
    return gl.NVMMASharedLayout.get_default_for(block, gl.float16)


def descriptor_type(block: list[int]) -> str:
    return f"tensordesc<fp16[{', '.join(map(str, block))}],{shared_layout(block)!r}>"


def compile_offline(nw: int) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sm90_compile import report
    names = depth_gate.arg_names
    pointers = {"table_ptr": "*i32", "task_counts": "*i32", "chunk_lists": "*i32", "chunk_counts": "*i32",
                "counters_ptr": "*i32", "failed_ptr": "*i32", "stamps_ptr": "*i64", "f32": "*fp32", "xt": "*fp16",
                "vectors": "*fp32", "cache": "*fp16", "emb": "*fp16", "codes": "*i32"}
    signature = dict(pointers, x_desc=descriptor_type([P.ROWS, P.CHUNK_K]), w_desc=descriptor_type([P.CHUNK_ROWS, P.CHUNK_K]),
                     prefetch="i32", stamps="i32", MAX_TASKS="constexpr", MAX_CHUNKS="constexpr", NW="constexpr",
                     num_warps="constexpr")
    aligned = {(names.index(name),): [["tt.divisibility", 16]] for name in pointers}
    source = GluonASTSource(depth_gate, signature, attrs=aligned,
                            constexprs={"MAX_TASKS": 384, "MAX_CHUNKS": 1280, "NW": nw, "num_warps": 4})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    print(f"NW={nw}: {report(kernel)}")


# ---------------------------------------------------------------- the GPU run


def random_model(g, dev="cuda"):
    """Random 1.7B code-predictor weights at the real shapes (fp16), norms near 1, inputs of positions 0, 1."""
    import torch

    def w(n, k):
        return (torch.randn(n, k, device=dev, generator=g) * 0.02).half()

    def gain(n):
        return 1 + 0.1 * torch.randn(n, device=dev, generator=g)
    layers = [dict(q=w(2048, P.HIDDEN), k=w(1024, P.HIDDEN), v=w(1024, P.HIDDEN), o=w(P.HIDDEN, 2048), gate=w(3072, P.HIDDEN),
                   up=w(3072, P.HIDDEN), down=w(P.HIDDEN, 3072), norm1=gain(P.HIDDEN), norm2=gain(P.HIDDEN), qnorm=gain(P.HEAD_DIM),
                   knorm=gain(P.HEAD_DIM)) for _ in range(P.LAYERS)]
    heads = [w(P.VOCAB, P.HIDDEN) for _ in range(P.POSITIONS - 1)]
    emb = torch.randn(P.POSITIONS - 1, P.VOCAB, P.HIDDEN, device=dev, generator=g).half()   # projected code embeddings
    inputs = torch.randn(2, P.ROWS, P.HIDDEN, device=dev, generator=g)
    inv = 1.0 / (1e6 ** (torch.arange(0, P.HEAD_DIM, 2, device=dev).float() / P.HEAD_DIM))
    angles = torch.arange(P.POSITIONS, device=dev).float()[:, None] * inv[None]
    angles = torch.cat([angles, angles], 1)
    return dict(layers=layers, heads=heads, emb=emb, inputs=inputs, final_norm=gain(P.HIDDEN), cos=angles.cos(),
                sin=angles.sin())


def qkv_rows(layer):
    """q/k/v weights stacked with rows grouped per kv head: q 2g, q 2g+1, k g, v g."""
    import torch
    parts = []
    for g in range(P.KV_HEADS):
        parts += [layer["q"][2 * g * P.HEAD_DIM:(2 * g + 2) * P.HEAD_DIM], layer["k"][g * P.HEAD_DIM:(g + 1) * P.HEAD_DIM],
                  layer["v"][g * P.HEAD_DIM:(g + 1) * P.HEAD_DIM]]
    return torch.cat(parts)


def device_buffers(model, lay):
    """The pre-tiled weights [chunks * 32, 256], parameters, and the host-given inputs in place."""
    import torch
    dev = model["inputs"].device
    pieces = {}
    for l, layer in enumerate(model["layers"]):
        pieces.update({f"qkv{l}": qkv_rows(layer), f"o{l}": layer["o"], f"gate{l}": layer["gate"],
                       f"up{l}": layer["up"], f"down{l}": layer["down"]})
    for p, head in enumerate(model["heads"]):
        pieces[f"head{p}"] = head
    weights = torch.empty(lay.chunk_count * P.CHUNK_ROWS, P.CHUNK_K, dtype=torch.float16, device=dev)
    for name, (first, n, k) in lay.weights.items():
        m = pieces[name]
        tiled = m.reshape(n // P.CHUNK_ROWS, P.CHUNK_ROWS, k // P.CHUNK_K, P.CHUNK_K).permute(0, 2, 1, 3).reshape(-1, P.CHUNK_K)
        weights[first * P.CHUNK_ROWS:first * P.CHUNK_ROWS + tiled.shape[0]] = tiled
    params = torch.zeros(lay.params_size, device=dev)
    for l, layer in enumerate(model["layers"]):
        for key in ("norm1", "norm2", "qnorm", "knorm"):
            at = lay.params[f"{key}_{l}"]
            params[at:at + layer[key].numel()] = layer[key]
    params[lay.params["final_norm"]:][:P.HIDDEN] = model["final_norm"]
    params[lay.params["cos"]:][:P.POSITIONS * P.HEAD_DIM] = model["cos"].flatten()
    params[lay.params["sin"]:][:P.POSITIONS * P.HEAD_DIM] = model["sin"].flatten()
    f32 = torch.zeros(lay.f32_size, device=dev)
    xt = torch.zeros(lay.tile_count * P.ROWS, P.CHUNK_K, dtype=torch.float16, device=dev)
    for i in range(2):   # positions 0 and 1: h, fp16 normed copy, full-row sum of squares (entry 0)
        h = model["inputs"][i]
        slot = P.RING + i
        f32[lay.f32[f"h{slot}"]:][:P.ROWS * P.HIDDEN] = h.flatten()
        f32[lay.f32[f"ss{slot}"]:][:P.ROWS] = (h * h).sum(1)
        hn = (h * model["layers"][0]["norm1"]).half()
        base = lay.tiles[f"hn{slot}"]
        xt[base * P.ROWS:(base + P.HIDDEN // P.CHUNK_K) * P.ROWS] = hn.reshape(P.ROWS, -1, P.CHUNK_K).transpose(0, 1).reshape(-1, P.CHUNK_K)
    return weights, params, f32, xt


def reference_logits(model, codes, positions=P.POSITIONS):
    """The real model's logits per position (norms before the GEMMs, fp16 GEMM inputs, fp32 else),
    each position's input from the kernel's own codes. [P.POSITIONS, rows, vocab], position 0 unused."""
    import torch
    f = torch.float32
    dev = model["inputs"].device

    def norm(x, g):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + EPS.value) * g

    def mm(x, w):
        return x.half().to(f) @ w.to(f).t()

    def rope(x, p):
        half = P.HEAD_DIM // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * model["cos"][p] + rotated * model["sin"][p]
    keys = [torch.zeros(P.ROWS, P.KV_HEADS, P.POSITIONS, P.HEAD_DIM, device=dev, dtype=torch.float16) for _ in model["layers"]]
    values = [torch.zeros_like(k) for k in keys]
    out = torch.zeros(P.POSITIONS, P.ROWS, P.VOCAB, device=dev)
    for p in range(positions):
        h = model["inputs"][p] if p < 2 else model["emb"][p - 2][codes[p - 1].long()].to(f)
        for l, layer in enumerate(model["layers"]):
            x = norm(h, layer["norm1"])
            q = mm(x, layer["q"]).view(P.ROWS, 16, P.HEAD_DIM)
            k = mm(x, layer["k"]).view(P.ROWS, P.KV_HEADS, P.HEAD_DIM)
            v = mm(x, layer["v"]).view(P.ROWS, P.KV_HEADS, P.HEAD_DIM)
            q, k = rope(norm(q, layer["qnorm"]), p), rope(norm(k, layer["knorm"]), p)
            keys[l][:, :, p], values[l][:, :, p] = k.half(), v.half()
            kk = keys[l][:, :, :p + 1].to(f).repeat_interleave(2, 1)
            vv = values[l][:, :, :p + 1].to(f).repeat_interleave(2, 1)
            att = torch.softmax(torch.einsum("rhd,rhjd->rhj", q, kk) / math.sqrt(P.HEAD_DIM), -1)
            h = h + mm(torch.einsum("rhj,rhjd->rhd", att, vv).reshape(P.ROWS, -1), layer["o"])
            x = norm(h, layer["norm2"])
            gate, up = mm(x, layer["gate"]), mm(x, layer["up"])
            h = h + mm(torch.nn.functional.silu(gate) * up, layer["down"])
        if p >= 1:
            out[p] = mm(norm(h, model["final_norm"]), model["heads"][p - 1])
    return out


def reference_draws(logits, seed_of, positions=P.POSITIONS):
    """The kernel's Gumbel-max draw in torch from given logits [positions, rows, vocab]."""
    import torch
    mask = 0xFFFFFFFF
    codes = torch.zeros(P.POSITIONS, P.ROWS, dtype=torch.long, device=logits.device)
    i = torch.arange(P.VOCAB, device=logits.device, dtype=torch.int64)
    for p in range(1, positions):
        for_rows = torch.arange(P.ROWS, device=logits.device, dtype=torch.int64)[:, None]
        x = (for_rows * P.VOCAB + i[None] + seed_of(p) * 7919) & mask
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & mask
        x = x ^ (x >> 15)
        x = (x * 0x2C1B3C6D) & mask
        x = x ^ (x >> 16)
        u = ((x >> 8).float() + 0.5) * (1.0 / 16777216.0)
        codes[p] = (logits[p] * (1.0 / TEMPERATURE.value) - torch.log(-torch.log(u))).argmax(-1)
    return codes


def run_on_gpu(replays: int, rounds: int, ring_sizes: list[int], out_dir: str | None, skip: set[int]) -> None:
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    ctas = torch.cuda.get_device_properties(0).multi_processor_count
    model = random_model(torch.Generator(device=DEVICE).manual_seed(0), DEVICE)
    plans = {waits: P.without(P.build(waits), skip) for waits in ("grid", "fine")}
    lay = plans["grid"].layout
    weights, params, f32, xt = device_buffers(model, lay)
    cache = torch.zeros(2 * P.CACHE_SIZE, dtype=torch.float16, device=DEVICE)
    codes = torch.zeros(P.POSITIONS * P.ROWS, dtype=torch.int32, device=DEVICE)
    emb = model["emb"].flatten()
    x_desc = TensorDescriptor.from_tensor(xt, [P.ROWS, P.CHUNK_K], shared_layout([P.ROWS, P.CHUNK_K]))
    w_desc = TensorDescriptor.from_tensor(weights, [P.CHUNK_ROWS, P.CHUNK_K], shared_layout([P.CHUNK_ROWS, P.CHUNK_K]))
    plan_of = {"grid-prefetch": (plans["grid"], 1), "grid-after": (plans["grid"], 0),
               "fine-prefetch": (plans["fine"], 1), "fine-after": (plans["fine"], 0),
               "fine-l2": (P.weights_from_l2(plans["fine"], 128), 1),
               "handoff": (P.handoff_only(plans["grid"]), 0)}
    per_plan = {name: P.per_cta(plan, ctas) for name, (plan, _) in plan_of.items()}
    max_tasks = max(len(l) for lists, _ in per_plan.values() for l in lists)
    max_chunks = max(max(len(c) for c in chunks) for _, chunks in per_plan.values())
    launches = {}
    for name, (plan, prefetch) in plan_of.items():
        lists, chunks = per_plan[name]
        table = torch.zeros(ctas, max_tasks, P.FIELDS, dtype=torch.int32)
        chunk_table = torch.zeros(ctas, max_chunks, dtype=torch.int32)
        for c in range(ctas):
            if lists[c]:
                table[c, :len(lists[c])] = torch.tensor([t.fields for t in lists[c]], dtype=torch.int32)
            if chunks[c]:
                chunk_table[c, :len(chunks[c])] = torch.tensor(chunks[c], dtype=torch.int32)
        launches[name] = dict(table=table.to(DEVICE), tasks=torch.tensor([len(l) for l in lists], dtype=torch.int32).to(DEVICE),
                              chunks=chunk_table.to(DEVICE),
                              chunk_counts=torch.tensor([len(c) for c in chunks], dtype=torch.int32).to(DEVICE),
                              prefetch=prefetch, plan=plan)
    counters = torch.zeros(plans["grid"].counters, dtype=torch.int32, device=DEVICE)
    failed = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    stamps = torch.zeros(plans["grid"].tasks, 3, dtype=torch.int64, device=DEVICE)

    def launch(name, nw, with_stamps=0):
        x = launches[name]
        counters.zero_()
        depth_gate[(ctas,)](x["table"], x["tasks"], x["chunks"], x["chunk_counts"], counters, failed, stamps, x_desc,
                            w_desc, f32, xt, params, cache, emb, codes, x["prefetch"], with_stamps,
                            MAX_TASKS=max_tasks, MAX_CHUNKS=max_chunks, NW=nw, num_warps=4)

    # (variant, ring slots): every variant at the first ring size; the prefetching ones at the others
    runs = [(name, ring_sizes[0]) for name in VARIANTS]
    runs += [(name, nw) for nw in ring_sizes[1:] for name in VARIANTS if name.endswith("prefetch")]
    label = {run: run[0] if run[1] == ring_sizes[0] else f"{run[0]} NW={run[1]}" for run in runs}
    import triton
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
               "ctas": ctas, "phases": len(plans["grid"].phases), "tasks": plans["grid"].tasks,
               "ring_sizes": ring_sizes, "variants": {}}
    for run in runs:   # compile each, and see that no wait timed out
        launch(*run)
        torch.cuda.synchronize()
        if failed.item():
            print(f"{label[run]}: a wait timed out (counters {counters.cpu().tolist()[:64]} ...); stopping")
            return
    times = {run: [] for run in runs}
    for _ in range(rounds):
        for run in runs:
            for _ in range(replays):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                launch(*run)
                end.record()
                end.synchronize()
                times[run].append(start.elapsed_time(end))
    phases = results["phases"]
    for run in runs:
        launch(*run, with_stamps=1)
        torch.cuda.synchronize()
        ms = statistics.median(times[run])
        results["variants"][label[run]] = dict(ms_per_frame=ms, us_per_phase=ms * 1000 / phases, times_ms=times[run],
                                               breakdown=stamp_breakdown(stamps.cpu(), launches[run[0]]["plan"]))
    try:
        results["numerics"] = numerics(model, lambda name: launch(name, ring_sizes[0]), f32, codes, lay)
    except Exception as error:   # the timings above stand without it
        import traceback
        traceback.print_exc()
        results["numerics"] = {"error": repr(error)}
    if out_dir:
        with open(os.path.join(out_dir, "depth_gate.json"), "w") as fh:
            json.dump(results, fh, indent=1)
    print(f"\n{results['device']}, torch {results['torch']}, Triton {results['triton']}: {phases} phases per 64-row 16-position frame, {ctas} CTAs; median of {rounds} x {replays} launches "
          f"each, alternated; per kind: mean hand-off / median task body / phase span, us (one stamped launch)")
    print("| variant | ms / frame | us / phase | " + " | ".join(KINDS) + " |")
    for name, v in results["variants"].items():
        cells = " | ".join("{:.2f} / {:.2f} / {:.2f}".format(*v["breakdown"][k]) if k in v["breakdown"] else "-"
                           for k in KINDS)
        print(f"| {name} | {v['ms_per_frame']:.3f} | {v['us_per_phase']:.2f} | {cells} |")
    print("numerics:", json.dumps({k: v for k, v in results["numerics"].items() if k != "per_position"}))


def numerics(model, launch, f32, codes, lay) -> dict:
    """The grid plan's logits against the reference given the kernel's codes, its draws against
    torch's, and the grid and fine plans' outputs bit-identical."""
    import torch
    at, size = lay.f32["logits"], P.POSITIONS * P.ROWS * P.VOCAB
    launch("grid-prefetch")
    torch.cuda.synchronize()
    logits, kernel_codes = f32[at:at + size].view(P.POSITIONS, P.ROWS, P.VOCAB).clone(), codes.view(P.POSITIONS, -1).clone()
    launch("fine-prefetch")
    torch.cuda.synchronize()
    identical = bool(torch.equal(logits, f32[at:at + size].view(P.POSITIONS, P.ROWS, P.VOCAB))
                     and torch.equal(kernel_codes, codes.view(P.POSITIONS, -1)))
    reference = reference_logits(model, kernel_codes)
    largest = reference[1:].abs().amax((1, 2))
    per_position = ((logits[1:] - reference[1:]).abs().amax((1, 2)) / largest).tolist()
    return dict(logit_error_over_largest=max(per_position), per_position=per_position,
                greedy_agreement=float((logits[1:].argmax(-1) == reference[1:].argmax(-1)).float().mean()),
                draws_equal_torch=float((reference_draws(logits, lambda p: 1000 + p)[1:] == kernel_codes[1:].long())
                                        .float().mean()),
                grid_and_fine_bit_identical=identical)


KINDS = ["qkv", "attn", "o", "gate/up", "down", "head", "draw"]


def stamp_breakdown(stamps, plan) -> dict[str, tuple[float, float, float]]:
    """Per phase kind, us: mean hand-off (the end of the phase before to its median task's start
    after the wait), mean of the median task body (that start to its signal), mean phase span (the
    end of the phase before to its own end)."""
    out: dict[str, list[tuple[float, float, float]]] = {}
    prev_end = None
    for name, tasks in zip(plan.phase_names, plan.phases):
        s = stamps[[t.fields[P.STAMP] for t in tasks]].double()
        ready, end = s[:, 1].median().item(), s[:, 2].max().item()
        if prev_end is not None:
            out.setdefault(name.split(" ")[0], []).append(((ready - prev_end) / 1000,
                                                           (s[:, 2] - s[:, 1]).median().item() / 1000,
                                                           (end - prev_end) / 1000))
        prev_end = end
    return {k: tuple(statistics.mean(x[i] for x in v) for i in range(3)) for k, v in out.items()}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true", help="compile for sm_90 offline and report; no GPU")
    ap.add_argument("--nw", default=str(NW), help="weight ring slots: one, or a list (GPU: the prefetching "
                                                  "variants again at the others)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--skip", default="", help="task kinds that only wait and signal, e.g. attn,draw")
    args = ap.parse_args()
    ring_sizes = [int(x) for x in args.nw.split(",")]
    if args.compile:
        for nw in ring_sizes:
            compile_offline(nw)
    else:
        kinds = {name: kind for kind, name in P.KIND_NAMES.items()}
        run_on_gpu(args.replays, args.rounds, ring_sizes, args.out, {kinds[k] for k in args.skip.split(",") if k})
