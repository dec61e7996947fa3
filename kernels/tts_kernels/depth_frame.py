"""The code predictor's frame (16 positions x every layer, the 15 heads and draws) as one
persistent Triton kernel: one launch of one CTA per SM walks the task lists of
tts_kernels.depth_schedule, each task waiting on a counter in global memory for the phase before
it (or for the part of it that it reads). The loop it replaces (tts_cli.model.depth, fused path)
launches ~850 kernels per frame, each paying launch, memory latency and ramp-up; here a phase
hand-off costs a counter round trip.

Numerics follow the loop's: activations fp32; every projection reads its fp32 input as the
loop's projections do (tts_kernels.linear: rounded once to fp16 over fp16 weights, as bf16 hi + lo
halves over bf16 ones, itself over fp32 ones), with fp32 sums; q, k and v rounded to the cache
dtype (the weights'); the attention's probabilities meet the values in that dtype; the draw is
tts_kernels.sampler.draw. Split-K partial sums are added in a fixed order by their consumer, so a
frame gives the same result every run.

Without SYNC (CPU, Triton's interpreter, which runs programs one after another) the host launches
one phase at a time instead, with that phase's tasks: the same task code, the launch boundary as
the barrier.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from tts_kernels import compiled
from tts_kernels import depth_schedule as plan
from tts_kernels.attention import norm_and_rotate
from tts_kernels.linear import parts_of, store_parts
from tts_kernels.sampler import count_nonfinite, draw

_EMBED = tl.constexpr(plan.EMBED)
_QKV = tl.constexpr(plan.QKV)
_ATTN = tl.constexpr(plan.ATTN)
_O = tl.constexpr(plan.O)
_NORM_2 = tl.constexpr(plan.NORM_2)
_GATE_UP = tl.constexpr(plan.GATE_UP)
_DOWN = tl.constexpr(plan.DOWN)
_NORM_1 = tl.constexpr(plan.NORM_1)
_HEAD = tl.constexpr(plan.HEAD)
_FIELDS = tl.constexpr(len(plan.FIELDS))
_POSITIONS = tl.constexpr(plan.POSITIONS)
ATTENTION_TASKS = 128   # attention tasks per phase at most: one per CTA (132 on the H200)


@triton.jit
def _now():
    """The GPU's global nanosecond timer (for the optional per-task timestamps)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _gemm(x_ptr, x_cols, w_ptr, w_cols, w2_offset, rows, n0, k0, K_LEN: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTS: tl.constexpr,
          PAIR: tl.constexpr):
    """x[:, k0:k0+K_LEN] @ w[n0:n0+BLOCK_N, k0:k0+K_LEN].T as fp32 [BLOCK_M, BLOCK_N]; with PAIR
    also the same for the weight rows w2_offset further (gate and up share one read of x). x is
    PARTS parts [PARTS, BLOCK_M, x_cols] (tts_kernels.linear), written so by the task that made x,
    so that they go to the tensor cores as loaded: with bf16 weights its bf16 hi and lo, with fp16
    weights x in fp16, with fp32 weights x itself."""
    r = tl.arange(0, BLOCK_M)
    n = n0 + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K_LEN, BLOCK_K):
        cols = k0 + k + kk
        x_offsets = r[:, None] * x_cols + cols[None, :]
        x = tl.load(x_ptr + x_offsets, mask=(r < rows)[:, None], other=0.0, cache_modifier=".cg")
        w_offsets = n[None, :] * w_cols + cols[:, None]
        w = tl.load(w_ptr + w_offsets)
        if PARTS == 2:
            hi = x
            lo = tl.load(x_ptr + BLOCK_M * x_cols + x_offsets, mask=(r < rows)[:, None], other=0.0,
                         cache_modifier=".cg")
            acc = tl.dot(hi, w, acc)
            acc = tl.dot(lo, w, acc)
            if PAIR:
                w2 = tl.load(w_ptr + w2_offset + w_offsets)
                acc2 = tl.dot(hi, w2, acc2)
                acc2 = tl.dot(lo, w2, acc2)
        elif w.dtype == tl.float32:   # fp32 weights: fp32 products
            acc = tl.dot(x, w, acc, input_precision="ieee")
            if PAIR:
                acc2 = tl.dot(x, tl.load(w_ptr + w2_offset + w_offsets), acc2, input_precision="ieee")
        else:   # fp16 weights: the input as written, rounded once to fp16
            acc = tl.dot(x, w, acc)
            if PAIR:
                acc2 = tl.dot(x, tl.load(w_ptr + w2_offset + w_offsets), acc2)
    return acc, acc2


@triton.jit
def _store_tile(out_ptr, out_cols, value, rows, n0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                PARTS: tl.constexpr = 1):
    """value [BLOCK_M, BLOCK_N] into out [PARTS, BLOCK_M, out_cols] at column n0: fp32 partial sums
    (PARTS 1), or a GEMM's input as its parts."""
    r = tl.arange(0, BLOCK_M)
    n = n0 + tl.arange(0, BLOCK_N)
    store_parts(out_ptr, r[:, None] * out_cols + n[None, :], BLOCK_M * out_cols, value, (r < rows)[:, None], PARTS)


@triton.jit
def _projection(x_ptr, w_ptr, out_ptr, tile, rows, N: tl.constexpr, K: tl.constexpr, N_TILE: tl.constexpr,
                SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PARTS: tl.constexpr):
    """One (n tile, k split) of x [BLOCK_M, K] @ w [N, K].T into out[split] [BLOCK_M, N]."""
    n0 = (tile // SPLITS) * N_TILE
    split = tile % SPLITS
    acc, _ = _gemm(x_ptr, K, w_ptr, K, 0, rows, n0, split * (K // SPLITS), K // SPLITS, BLOCK_M, N_TILE,
                   BLOCK_K, PARTS, False)
    _store_tile(out_ptr + split * BLOCK_M * N, N, acc, rows, n0, BLOCK_M, N_TILE)


@triton.jit
def _residual_norm(h_ptr, xn_ptr, part_ptr, norm_ptr, row, eps, SPLITS: tl.constexpr, D: tl.constexpr,
                   DB: tl.constexpr, BLOCK_M: tl.constexpr, PARTS: tl.constexpr):
    """h[row] += the SPLITS partial sums, in order; xn[row] = RMSNorm(h[row]) * norm."""
    d = tl.arange(0, DB)
    valid = d < D
    h = tl.load(h_ptr + row * D + d, mask=valid, other=0.0, cache_modifier=".cg")
    delta = tl.zeros([DB], tl.float32)
    for s in range(SPLITS):
        delta += tl.load(part_ptr + (s * BLOCK_M + row) * D + d, mask=valid, other=0.0, cache_modifier=".cg")
    h += delta
    _store_normed(h, h_ptr, xn_ptr, norm_ptr, row, eps, D, DB, BLOCK_M, PARTS)


@triton.jit
def _store_normed(h, h_ptr, xn_ptr, norm_ptr, row, eps, D: tl.constexpr, DB: tl.constexpr, BLOCK_M: tl.constexpr,
                  PARTS: tl.constexpr):
    """h [DB] -> h[row]; RMSNorm(h) * norm -> xn[:, row] as PARTS parts (the GEMMs' input)."""
    d = tl.arange(0, DB)
    valid = d < D
    tl.store(h_ptr + row * D + d, h, mask=valid)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + eps)
    store_parts(xn_ptr, row * D + d, BLOCK_M * D, tl.load(norm_ptr + d, mask=valid, other=0.0).to(tl.float32) *
                (h * rstd), valid, PARTS)


@triton.jit
def _head_vectors(qkv_ptr, r, valid, head, dims, partner, norm_ptr, cos, sin, eps, NORM: tl.constexpr,
                  QKV_N: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, HD: tl.constexpr):
    """Head vectors [entries, HDB] from the q/k/v partial sums, entry e head head[e] of row r[e]
    (zeros where not valid): with NORM, RMS-normed and rotated (RoPE, rotate-half) as the loop's
    attention kernel does; else raw (v)."""
    mask = valid[:, None] & (dims < HD)[None, :]
    offsets = head[:, None] * HD + dims[None, :]
    partner_offsets = head[:, None] * HD + partner[None, :]
    x = tl.zeros([r.shape[0], dims.shape[0]], tl.float32)
    x_partner = tl.zeros([r.shape[0], dims.shape[0]], tl.float32)
    for s in range(SPLITS):
        base = qkv_ptr + ((s * BLOCK_M + r) * QKV_N)[:, None]
        x += tl.load(base + offsets, mask=mask, other=0.0, cache_modifier=".cg")
        if NORM:
            x_partner += tl.load(base + partner_offsets, mask=mask, other=0.0, cache_modifier=".cg")
    if NORM:
        weight = tl.load(norm_ptr + dims, mask=dims < HD, other=0.0).to(tl.float32)[None, :]
        weight_partner = tl.load(norm_ptr + partner, mask=dims < HD, other=0.0).to(tl.float32)[None, :]
        x = norm_and_rotate(x, x_partner, weight, weight_partner, (dims < HD // 2)[None, :], cos[None, :],
                            sin[None, :], eps, HD)
    return x


@triton.jit
def _per_entry(x, ROWS: tl.constexpr, EACH: tl.constexpr, HDB: tl.constexpr):
    """x [ROWS, HDB] repeated EACH times per row: [ROWS * EACH, HDB]."""
    return tl.reshape(tl.broadcast_to(x[:, None, :], (ROWS, EACH, HDB)), (ROWS * EACH, HDB))


@triton.jit
def _attention(qkv_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
               tile, position, rows, eps, scale,
               QH: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, HDB: tl.constexpr, QKV_N: tl.constexpr,
               SPLITS: tl.constexpr, ATTN_ROWS: tl.constexpr, ATTN_Q: tl.constexpr, BLOCK_M: tl.constexpr,
               PARTS: tl.constexpr):
    """One kv head for ATTN_ROWS rows at `position`: q/k norm + RoPE, k and v into the frame's
    cache ([BLOCK_M, KVH, POSITIONS, HD] of this layer), causal attention over positions
    0..position. The rows' query heads (ATTN_Q entries, padded) meet every key of the task's rows
    in one tensor-core product and keys of other rows are masked: at these sizes wasted products
    cost less than per-row tensors."""
    GROUPS: tl.constexpr = QH // KVH
    kv_head = tile % KVH
    first = (tile // KVH) * ATTN_ROWS
    dims = tl.arange(0, HDB)
    partner = (dims + HD // 2) % HD
    in_head = dims < HD
    cos = tl.load(cos_ptr + position * HD + dims, mask=in_head, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * HD + dims, mask=in_head, other=0.0).to(tl.float32)
    cache_type = k_cache_ptr.dtype.element_ty
    # the earlier positions' keys and values of the task's rows first (no dependency on this task's
    # stores below): entry e is position e % POSITIONS of row first + e // POSITIONS
    e = tl.arange(0, ATTN_ROWS * _POSITIONS)
    key_row = first + e // _POSITIONS
    key_position = e % _POSITIONS
    cached = ((key_row * KVH + kv_head) * _POSITIONS + key_position)[:, None] * HD + dims[None, :]
    earlier = ((key_row < rows) & (key_position < position))[:, None] & in_head[None, :]
    keys = tl.load(k_cache_ptr + cached, mask=earlier, other=0.0, cache_modifier=".cg")
    values = tl.load(v_cache_ptr + cached, mask=earlier, other=0.0, cache_modifier=".cg")
    # this position's keys and values: into the cache, and in place of the entries at `position`
    r = first + tl.arange(0, ATTN_ROWS)
    valid_r = r < rows
    kv_here = ((r * KVH + kv_head) * _POSITIONS + position)[:, None] * HD + dims[None, :]
    store_mask = valid_r[:, None] & in_head[None, :]
    here = (key_position == position)[:, None]
    k_head = tl.full([ATTN_ROWS], QH, tl.int32) + kv_head     # this kv head's key, then value, for each row
    k = _head_vectors(qkv_ptr, r, valid_r, k_head, dims, partner, k_norm_ptr, cos, sin, eps, True,
                      QKV_N, SPLITS, BLOCK_M, HD).to(cache_type, fp_downcast_rounding="rtne")
    tl.store(k_cache_ptr + kv_here, k, mask=store_mask)
    keys = tl.where(here, _per_entry(k, ATTN_ROWS, _POSITIONS, HDB), keys)
    v = _head_vectors(qkv_ptr, r, valid_r, k_head + KVH, dims, partner, k_norm_ptr, cos, sin, eps,
                      False, QKV_N, SPLITS, BLOCK_M, HD).to(cache_type, fp_downcast_rounding="rtne")
    tl.store(v_cache_ptr + kv_here, v, mask=store_mask)
    values = tl.where(here, _per_entry(v, ATTN_ROWS, _POSITIONS, HDB), values)
    # queries: entry i is head kv_head * GROUPS + i % GROUPS of row first + i // GROUPS; padding
    # entries repeat the first row (never stored), so that no entry is without keys
    i = tl.arange(0, ATTN_Q)
    q_valid = (i < ATTN_ROWS * GROUPS) & (first + i // GROUPS < rows)
    q_row = tl.where(i < ATTN_ROWS * GROUPS, first + i // GROUPS, first)
    q_head = kv_head * GROUPS + i % GROUPS
    q = _head_vectors(qkv_ptr, q_row, q_valid, q_head, dims, partner, q_norm_ptr, cos, sin, eps, True,
                      QKV_N, SPLITS, BLOCK_M, HD).to(cache_type, fp_downcast_rounding="rtne")
    if cache_type == tl.float32:
        scores = tl.dot(q, tl.trans(keys), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(keys))
    own = (key_row[None, :] == q_row[:, None]) & (key_position <= position)[None, :]
    scores = tl.where(own, scores * scale, float("-inf"))                    # [ATTN_Q, keys]
    best = tl.max(scores, axis=1)
    p = tl.exp(scores - best[:, None])
    total = tl.sum(p, axis=1)
    if cache_type == tl.float32:
        out = tl.dot(p, values, input_precision="ieee")
    else:
        out = tl.dot(p.to(cache_type), values)
    out = out / total[:, None]
    store_parts(out_ptr, (q_row * QH + q_head)[:, None] * HD + dims[None, :], BLOCK_M * QH * HD, out,
                q_valid[:, None] & in_head[None, :], PARTS)


@triton.jit
def _embed(x_in_ptr, tables_ptr, logit_part_ptr, logits_out_ptr, codes_ptr, forced_ptr, h_ptr, xn_ptr, norm_ptr,
           temperature_ptr, top_k_ptr, do_sample_ptr, seeds_ptr, frame_ptr, frame_stride, nonfinite_ptr,
           row, position, rows, eps,
           D: tl.constexpr, DB: tl.constexpr, V: tl.constexpr, VB: tl.constexpr, HEAD_SPLITS: tl.constexpr,
           BLOCK_M: tl.constexpr, FORCED: tl.constexpr, STORE_LOGITS: tl.constexpr, LIBDEVICE: tl.constexpr,
           PARTS: tl.constexpr, COUNT: tl.constexpr):
    """One row at `position`: from position 2 on, first the draw of codebook position - 1 from the
    head's partial logits (with COUNT, its NaN and +inf logits added to the count at nonfinite_ptr,
    as the sampler kernel does); then (positions 0..15) the input, h = it and xn = norm_1 of layer 0."""
    if row < rows:
        code = tl.zeros([], tl.int64)
        if position >= 2:
            group = position - 1
            tokens = tl.arange(0, VB)
            valid = tokens < V
            logits = tl.zeros([VB], tl.float32)
            for s in range(HEAD_SPLITS):
                logits += tl.load(logit_part_ptr + (s * BLOCK_M + row) * V + tokens, mask=valid, other=0.0,
                                  cache_modifier=".cg")
            if STORE_LOGITS:
                tl.store(logits_out_ptr + (row * 15 + group - 1) * V + tokens, logits, mask=valid)
            if COUNT:
                count_nonfinite(nonfinite_ptr, logits)
            if FORCED:
                code = tl.load(forced_ptr + row * 15 + group - 1)
            else:
                code = draw(tl.where(valid, logits, float("-inf")), tokens, valid, tl.load(temperature_ptr + row),
                            tl.load(top_k_ptr + row), tl.load(seeds_ptr + row),
                            tl.load(frame_ptr + row * frame_stride), group,
                            tl.load(do_sample_ptr + row).to(tl.int1), V, LIBDEVICE)
            tl.store(codes_ptr + row * 15 + group - 1, code)
        if position < _POSITIONS:
            d = tl.arange(0, DB)
            valid_d = d < D
            if position < 2:
                x = tl.load(x_in_ptr + (position * BLOCK_M + row) * D + d, mask=valid_d, other=0.0)
            else:
                x = tl.load(tables_ptr + ((position - 2) * V + code) * D + d, mask=valid_d, other=0.0)
            _store_normed(x, h_ptr, xn_ptr, norm_ptr, row, eps, D, DB, BLOCK_M, PARTS)


@triton.jit
def _depth_frame(table_ptr, counters_ptr,
                 x_in_ptr, h_ptr, xn_ptr, qkv_ptr, attn_ptr, part_ptr, act_ptr, logit_part_ptr,
                 k_cache_ptr, v_cache_ptr, logits_out_ptr, codes_ptr, forced_ptr, times_ptr,
                 norm_1_ptr, norm_2_ptr, q_norm_ptr, k_norm_ptr, w_qkv_ptr, w_o_ptr, w_gate_up_ptr, w_down_ptr,
                 heads_ptr, tables_ptr, cos_ptr, sin_ptr,
                 temperature_ptr, top_k_ptr, do_sample_ptr, seeds_ptr, frame_ptr, frame_stride, nonfinite_ptr,
                 rows, eps, scale,
                 D: tl.constexpr, DB: tl.constexpr, I: tl.constexpr, QH: tl.constexpr, KVH: tl.constexpr,
                 HD: tl.constexpr, HDB: tl.constexpr, V: tl.constexpr, VB: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                 QKV_N_TILE: tl.constexpr, QKV_SPLITS: tl.constexpr, O_N_TILE: tl.constexpr, O_SPLITS: tl.constexpr,
                 GATE_UP_N_TILE: tl.constexpr, GATE_UP_BLOCK_K: tl.constexpr, DOWN_N_TILE: tl.constexpr,
                 DOWN_SPLITS: tl.constexpr, DOWN_BLOCK_K: tl.constexpr,
                 HEAD_N_TILE: tl.constexpr, HEAD_SPLITS: tl.constexpr, ATTN_ROWS: tl.constexpr,
                 MAX_TASKS: tl.constexpr, PARTS: tl.constexpr, SYNC: tl.constexpr, FORCED: tl.constexpr,
                 STORE_LOGITS: tl.constexpr, LIBDEVICE: tl.constexpr, TIMING: tl.constexpr, COUNT: tl.constexpr,
                 ATTN_Q: tl.constexpr):
    QKV_N: tl.constexpr = (QH + 2 * KVH) * HD
    cta = tl.program_id(0)
    for t in range(MAX_TASKS):
        task = table_ptr + (cta * MAX_TASKS + t) * _FIELDS
        kind = tl.load(task)
        if kind >= 0:   # padding entries: -1
            signal = tl.load(task + 7)
            position = tl.load(task + 2)
            layer = tl.load(task + 3)
            tile = tl.load(task + 4)
            stamps = times_ptr + (cta * MAX_TASKS + t) * 3
            if TIMING:
                tl.store(stamps, _now())
            if SYNC:
                wait_counter = tl.load(task + 5)
                if wait_counter >= 0:
                    wait_count = tl.load(task + 6)
                    seen = tl.atomic_add(counters_ptr + wait_counter, 0, sem="acquire", scope="gpu")
                    while seen < wait_count:
                        seen = tl.atomic_add(counters_ptr + wait_counter, 0, sem="acquire", scope="gpu")
                tl.debug_barrier()
            if TIMING:
                tl.store(stamps + 1, _now())
            if kind == _EMBED:
                _embed(x_in_ptr, tables_ptr, logit_part_ptr, logits_out_ptr, codes_ptr, forced_ptr, h_ptr, xn_ptr,
                       norm_1_ptr, temperature_ptr, top_k_ptr, do_sample_ptr, seeds_ptr, frame_ptr, frame_stride,
                       nonfinite_ptr, tile, position, rows, eps, D, DB, V, VB, HEAD_SPLITS, BLOCK_M, FORCED, STORE_LOGITS,
                       LIBDEVICE, PARTS, COUNT)
            elif kind == _QKV:
                _projection(xn_ptr, w_qkv_ptr + layer * QKV_N * D, qkv_ptr, tile, rows, QKV_N, D, QKV_N_TILE,
                            QKV_SPLITS, BLOCK_M, BLOCK_K, PARTS)
            elif kind == _ATTN:
                cache = layer * BLOCK_M * KVH * _POSITIONS * HD
                _attention(qkv_ptr, q_norm_ptr + layer * HD, k_norm_ptr + layer * HD, cos_ptr, sin_ptr,
                           k_cache_ptr + cache, v_cache_ptr + cache, attn_ptr, tile, position, rows, eps, scale,
                           QH, KVH, HD, HDB, QKV_N, QKV_SPLITS, ATTN_ROWS, ATTN_Q, BLOCK_M, PARTS)
            elif kind == _O:
                _projection(attn_ptr, w_o_ptr + layer * D * QH * HD, part_ptr, tile, rows, D, QH * HD, O_N_TILE,
                            O_SPLITS, BLOCK_M, BLOCK_K, PARTS)
            elif kind == _NORM_2:
                _residual_norm(h_ptr, xn_ptr, part_ptr, norm_2_ptr + layer * D, tile, eps, O_SPLITS, D, DB,
                               BLOCK_M, PARTS)
            elif kind == _GATE_UP:
                n0 = tile * GATE_UP_N_TILE
                gate, up = _gemm(xn_ptr, D, w_gate_up_ptr + layer * 2 * I * D, D, I * D, rows, n0, 0, D, BLOCK_M,
                                 GATE_UP_N_TILE, GATE_UP_BLOCK_K, PARTS, True)
                _store_tile(act_ptr, I, gate / (1.0 + tl.exp(-gate)) * up, rows, n0, BLOCK_M, GATE_UP_N_TILE, PARTS)
            elif kind == _DOWN:
                _projection(act_ptr, w_down_ptr + layer * D * I, part_ptr, tile, rows, D, I, DOWN_N_TILE,
                            DOWN_SPLITS, BLOCK_M, DOWN_BLOCK_K, PARTS)
            elif kind == _NORM_1:
                _residual_norm(h_ptr, xn_ptr, part_ptr, norm_1_ptr + layer * D, tile, eps, DOWN_SPLITS, D, DB,
                               BLOCK_M, PARTS)
            else:   # _HEAD
                _projection(xn_ptr, heads_ptr + (position - 1) * V * D, logit_part_ptr, tile, rows, V, D,
                            HEAD_N_TILE, HEAD_SPLITS, BLOCK_M, BLOCK_K, PARTS)
            if SYNC:
                tl.debug_barrier()
                if TIMING:
                    tl.store(stamps + 2, _now())
                tl.atomic_add(counters_ptr + signal, 1, sem="release", scope="gpu")


def shapes_for(hidden: int, intermediate: int, q_heads: int, kv_heads: int, head_dim: int, vocab: int, layers: int,
               rows: int) -> plan.Shapes:
    """The tiles for a code predictor's shapes: depth_schedule.Shapes' defaults (the 1.7B and 0.6B
    code predictors), halved where they do not divide smaller shapes (block_k down to 16, what a
    tensor-core dot needs); rows per attention task by attention_rows."""
    block_m = plan.row_tile(rows)
    default = plan.Shapes(hidden, intermediate, q_heads, kv_heads, head_dim, vocab, layers, block_m)
    tiles = {}
    for kind, (n, k, n_tile, splits, block_k) in default.gemms().items():
        while n % n_tile:
            n_tile //= 2
        while block_k > 16 and k % block_k:
            block_k //= 2
        while k % (splits * block_k):
            splits //= 2
        tiles[kind] = n_tile, splits, block_k
    return plan.Shapes(hidden, intermediate, q_heads, kv_heads, head_dim, vocab, layers, block_m,
                       block_k=min(tiles[plan.QKV][2], tiles[plan.O][2], tiles[plan.HEAD][2]),
                       qkv_n=tiles[plan.QKV][0], qkv_splits=tiles[plan.QKV][1], o_n=tiles[plan.O][0],
                       o_splits=tiles[plan.O][1], gate_up_n=tiles[plan.GATE_UP][0],
                       gate_up_block_k=tiles[plan.GATE_UP][2], down_n=tiles[plan.DOWN][0],
                       down_splits=tiles[plan.DOWN][1], down_block_k=tiles[plan.DOWN][2], head_n=tiles[plan.HEAD][0],
                       head_splits=tiles[plan.HEAD][1], attn_rows=attention_rows(block_m, kv_heads))


def attention_rows(block_m: int, kv_heads: int) -> int:
    """Rows per attention task: the fewest that make at most ATTENTION_TASKS tasks (kv heads x row
    blocks), one per CTA. Fewer rows per task shorten the task (H200, fp16, ms per frame, measured
    with the attention of 8fc1228, per-row tensors: 16-row tile, 1 row per task 2.46 against 2.84
    with 4 at 1 row, 2.55 against 2.94 at 16 rows; 64-row tile, 4 per task 3.21 against 3.44 with
    2, two rounds of tasks, and 4.21 with 8)."""
    return min(block_m, triton.next_power_of_2(max(1, -(-block_m * kv_heads // ATTENTION_TASKS))))


def _table(tasks: list[list[tuple[int, ...]]], device) -> tuple[torch.Tensor, int]:
    """[ctas, max tasks, FIELDS] int32, padded with kind -1."""
    most = max(1, max(len(t) for t in tasks))
    table = torch.full((len(tasks), most, len(plan.FIELDS)), -1, dtype=torch.int32)
    for cta, entries in enumerate(tasks):
        if entries:
            table[cta, :len(entries)] = torch.tensor(entries, dtype=torch.int32)
    return table.to(device), most


class DepthFrame:
    """The persistent frame for one code predictor (tts_cli.model.depth.CodePredictor with its fused
    tables prepared) and up to 64 rows. run() takes the frame's two first inputs (the projected
    talker state and codebook-0 embedding) and the rows' sampler settings, and returns codebooks
    1..15, as CodePredictor.predict_frame does with the sampler kernel's draws."""

    def __init__(self, cp, rows: int, sync: bool | None = None, ctas: int | None = None, timed: bool = False,
                 tiles: dict | None = None, num_warps: int | None = None, num_stages: int | None = None):
        """timed (GPU only): every task records when it started waiting, started and ended (the
        global timer, ns) into self.times [ctas, tasks, 3], for breakdown(). tiles: Shapes fields
        to override (tools/depth_bench.py tries tilings). num_warps: by default 8 over fp16
        weights, 4 over bf16 ones (H200, 64 rows, ms per frame: fp16 3.29 with 8, 4.38 with 4;
        bf16 4.63 with 4, 5.01 with 8; docs/bench.md), and 4 in the 16-row tile over fp16 ones
        (`tts bench`, docs/bench.md at 0bca9b7, 2026-12-01: depth 2.366 against 2.39 ms per step at
        c1, 2.41 against 2.43 at c8). num_stages: Triton's software pipelining
        of the K loops, by default 4 over fp16 weights (H200, 8 warps, ms per frame at 64 / 16
        rows: 2.77 / 2.40 with 4 stages, 2.86 / 2.46 with Triton's 3, 2.80 / 2.43 with 5, 3.34 at
        64 rows with 2), Triton's default over bf16 ones."""
        decoder, cfg = cp.decoder, cp.decoder.cfg
        device = decoder.norm.weight.device
        self.sync = device.type == "cuda" and compiled() if sync is None else sync
        if ctas is None:
            ctas = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else ctas
        self.rows = rows
        weight = decoder.layers[0].mlp.down_proj.weight
        vocab = cp.heads[0].weight.shape[0]
        self.shapes = dataclasses.replace(shapes_for(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                                                     cfg.num_kv_heads, cfg.head_dim, vocab, cfg.num_layers, rows),
                                          **(tiles or {}))
        if num_warps is None:   # by the tile the launch computes (tiles may override it)
            num_warps = (4 if self.shapes.rows == 16 else 8) if weight.dtype == torch.float16 else 4
        if num_stages is None and weight.dtype == torch.float16:
            num_stages = 4
        self.launch_options = dict(num_warps=num_warps) if num_stages is None else dict(num_warps=num_warps,
                                                                                        num_stages=num_stages)
        self.schedule = plan.build(self.shapes, ctas, sms)
        layers = decoder.layers
        stack = lambda get: torch.stack([get(layer).detach() for layer in layers]).contiguous()
        self.parts = parts_of(weight.dtype)
        self.weights = dict(
            norm_1=torch.cat([stack(lambda l: l.input_layernorm.weight), decoder.norm.weight.detach()[None]]),
            norm_2=stack(lambda l: l.post_attention_layernorm.weight),
            q_norm=stack(lambda l: l.self_attn.q_norm.weight), k_norm=stack(lambda l: l.self_attn.k_norm.weight),
            w_qkv=stack(lambda l: torch.cat([l.self_attn.q_proj.weight, l.self_attn.k_proj.weight,
                                             l.self_attn.v_proj.weight])),
            w_o=stack(lambda l: l.self_attn.o_proj.weight),
            w_gate_up=stack(lambda l: torch.cat([l.mlp.gate_proj.weight, l.mlp.up_proj.weight])),
            w_down=stack(lambda l: l.mlp.down_proj.weight),
            heads=torch.stack([h.weight.detach() for h in cp.heads]).contiguous())
        cp.prepare_fused()
        self.tables = cp.fused_tables[0]
        decoder.cache_rope(plan.POSITIONS)
        self.cos, self.sin = decoder.rope_tables[-1]
        s, m, d = self.shapes, self.shapes.rows, cfg.hidden_size
        qkv_n = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        f32 = dict(device=device, dtype=torch.float32)
        # the GEMMs' inputs as PARTS parts (bf16 hi and lo with bf16 weights), the rest fp32
        parts = dict(device=device, dtype=weight.dtype)
        self.scratch = dict(
            x_in=torch.zeros(2, m, d, **f32), h=torch.zeros(m, d, **f32), xn=torch.zeros(self.parts, m, d, **parts),
            qkv=torch.zeros(s.qkv_splits, m, qkv_n, **f32),
            attn=torch.zeros(self.parts, m, cfg.num_heads * cfg.head_dim, **parts),
            part=torch.zeros(max(s.o_splits, s.down_splits), m, d, **f32),
            act=torch.zeros(self.parts, m, cfg.intermediate_size, **parts),
            logit_part=torch.zeros(s.head_splits, m, vocab, **f32),
            k_cache=torch.zeros(cfg.num_layers, m, cfg.num_kv_heads, plan.POSITIONS, cfg.head_dim, device=device,
                                dtype=weight.dtype))
        self.scratch["v_cache"] = torch.zeros_like(self.scratch["k_cache"])
        self.logits = torch.zeros(m, plan.GROUPS, vocab, **f32)
        self.codes = torch.zeros(m, plan.GROUPS, device=device, dtype=torch.int64)
        self.counters = torch.zeros(self.schedule.counters, device=device, dtype=torch.int32)
        self.eps, self.scale = cfg.rms_norm_eps, cfg.head_dim ** -0.5
        self.timed = timed and self.sync
        self.times = torch.zeros(ctas, self.schedule.max_tasks if self.timed else 1, 3, device=device,
                                 dtype=torch.int64)
        if self.sync:
            self.tables_per_launch = [_table(self.schedule.table, device)]
        else:   # one launch per phase, each with that phase's tasks
            by_phase = [[[task for task in tasks if task[1] == phase] for tasks in self.schedule.table]
                        for phase in range(len(self.schedule.phases))]
            self.tables_per_launch = [_table(tasks, device) for tasks in by_phase]

    @torch.no_grad()
    def run(self, x_in: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, do_sample: torch.Tensor,
            seeds: torch.Tensor, frame: torch.Tensor, forced_codes: torch.Tensor | None = None,
            store_logits: bool = False, nonfinite: torch.Tensor | None = None) -> torch.Tensor:
        """x_in [2, B, D] fp32: the projected talker state and codebook-0 embedding of each row;
        temperature [B, 1] or [B]; top_k, do_sample, seeds, frame [B]. forced_codes [B, 15]:
        teacher forcing (the draws are skipped). Returns codes [B, 15] (a view of a buffer the next
        run overwrites); with store_logits, self.logits[:B] holds the 15 heads' logits. nonfinite
        (int32 [1]): gets the count of NaN and +inf logits added, as tts_kernels.sampler does."""
        b = x_in.shape[1]
        if b > self.shapes.rows:
            raise ValueError(f"{b} rows in a depth frame built for {self.rows}")
        scratch, weights, s = self.scratch, self.weights, self.shapes
        scratch["x_in"][:, :b].copy_(x_in)
        if self.sync:
            self.counters.zero_()
        forced = forced_codes if forced_codes is not None else self.codes
        frame = frame.reshape(-1)
        for table, most in self.tables_per_launch:
            _depth_frame[(self.schedule.ctas,)](
                table, self.counters, scratch["x_in"], scratch["h"], scratch["xn"], scratch["qkv"], scratch["attn"],
                scratch["part"], scratch["act"], scratch["logit_part"], scratch["k_cache"], scratch["v_cache"],
                self.logits, self.codes, forced.contiguous(), self.times, weights["norm_1"], weights["norm_2"],
                weights["q_norm"], weights["k_norm"], weights["w_qkv"], weights["w_o"], weights["w_gate_up"],
                weights["w_down"], weights["heads"], self.tables, self.cos, self.sin,
                temperature.reshape(-1).contiguous(), top_k.contiguous(), do_sample.contiguous(), seeds.contiguous(),
                frame, frame.stride(0) if frame.numel() > 1 else 0, nonfinite if nonfinite is not None else self.counters,
                b, self.eps, self.scale,
                D=s.hidden, DB=triton.next_power_of_2(s.hidden), I=s.intermediate, QH=s.q_heads, KVH=s.kv_heads,
                HD=s.head_dim, HDB=max(16, triton.next_power_of_2(s.head_dim)), V=s.vocab,
                VB=triton.next_power_of_2(s.vocab), BLOCK_M=s.rows, BLOCK_K=s.block_k,
                QKV_N_TILE=s.qkv_n, QKV_SPLITS=s.qkv_splits, O_N_TILE=s.o_n, O_SPLITS=s.o_splits,
                GATE_UP_N_TILE=s.gate_up_n, GATE_UP_BLOCK_K=s.gate_up_block_k, DOWN_N_TILE=s.down_n,
                DOWN_SPLITS=s.down_splits, DOWN_BLOCK_K=s.down_block_k,
                HEAD_N_TILE=s.head_n, HEAD_SPLITS=s.head_splits, ATTN_ROWS=s.attn_rows, MAX_TASKS=most,
                PARTS=self.parts, SYNC=self.sync, FORCED=forced_codes is not None, STORE_LOGITS=store_logits,
                LIBDEVICE=compiled(), TIMING=self.timed, COUNT=nonfinite is not None,
                ATTN_Q=max(16, triton.next_power_of_2(s.attn_rows * (s.q_heads // s.kv_heads))),
                **self.launch_options)
        return self.codes[:b]

    def breakdown(self) -> dict[str, dict[str, float]]:
        """From the last timed run, per task kind (microseconds): `frame_share`, the frame time
        spent between the end of the phase before and the end of the kind's phases (their critical
        path); `handoff`, from the end of the phase before to the median task's start; `body`, the
        mean task body."""
        times = self.times.cpu().double() / 1000
        phases = self.schedule.phases
        ends = [0.0] * len(phases)
        starts: list[list[float]] = [[] for _ in phases]
        bodies: list[list[float]] = [[] for _ in phases]
        for cta, tasks in enumerate(self.schedule.table):
            for i, task in enumerate(tasks):
                _, start, end = times[cta, i].tolist()
                ends[task[1]] = max(ends[task[1]], end)
                starts[task[1]].append(start)
                bodies[task[1]].append(end - start)
        out: dict[str, dict[str, float]] = {}
        first = min(min(s) for s in starts)
        for index, phase in enumerate(phases):
            before = ends[index - 1] if index else first
            entry = out.setdefault(plan.KIND_NAMES[phase.kind], dict(frame_share=0.0, handoff=0.0, body=0.0, phases=0))
            entry["frame_share"] += ends[index] - before
            entry["handoff"] += sorted(starts[index])[len(starts[index]) // 2] - before
            entry["body"] += sum(bodies[index]) / len(bodies[index])
            entry["phases"] += 1
        for entry in out.values():
            entry["handoff"] /= entry["phases"]
            entry["body"] /= entry["phases"]
        out["frame"] = dict(total=max(ends) - first)
        return out


def unsupported(cp, rows: int) -> str | None:
    """Why the persistent frame cannot run for this code predictor and row count here, or None.
    It needs every CTA resident at once on a Hopper GPU of at least 128 SMs, fp16 or bf16 weights,
    at most 64 rows, and shapes its tiles divide."""
    weight = cp.decoder.norm.weight
    if weight.device.type != "cuda":
        return f"it runs on CUDA GPUs, not {weight.device.type}"
    if not compiled():
        return "Triton's interpreter runs programs one at a time, and the kernel's CTAs wait on each other"
    props = torch.cuda.get_device_properties(weight.device)
    if (props.major, props.minor) != (9, 0):
        return f"it is built and measured for Hopper (sm_90), not sm_{props.major}{props.minor}"
    if props.multi_processor_count < 128:
        return f"the GPU has {props.multi_processor_count} SMs, the kernel's tiles are planned for 128 or more"
    dtype = cp.decoder.layers[0].mlp.down_proj.weight.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        return f"the weights are {dtype}, the kernel reads fp16 or bf16"
    if rows > plan.ROW_TILES[-1]:
        return f"{rows} rows: the kernel runs up to {plan.ROW_TILES[-1]} rows"
    cfg = cp.decoder.cfg
    try:
        shapes_for(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cp.heads[0].weight.shape[0], cfg.num_layers, rows).check()
    except ValueError as e:
        return f"unsupported shapes: {e}"
    return None
