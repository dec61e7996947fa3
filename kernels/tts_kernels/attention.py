"""The attention half of a decoder layer for a few new tokens per row against a static KV cache,
as one Triton kernel (torch takes ~25 small kernels: views, two RMSNorms, rotate-half RoPE, cache
scatter, two batched matmuls, scale, mask, softmax, casts). One program per (row, kv head): it
RMS-norms and rotates the row's new keys and writes them and the values to the cache at the
tokens' positions, then its query heads' new queries (normed and rotated the same way) attend to
the cached keys at positions <= their own (causal by position: the caller's keys beyond a row's
position are stale or empty and never read). One kernel instead of a rope-and-store kernel and an
attention kernel saves a launch per layer and position (~2.8 us each on the H200, 103 per c64
step: tools/step_profile.py). For one token per row against a short cache (the code predictor's
frame) from 64 rows, _decode_attention does the same in one warp per program (takes_decode_kernel).

A row's S new tokens go to cache positions start, start + 1, ...: `start` is one int for every row
(the code predictor) or a [B] tensor (the talker step, a packed prefill tile). RoPE uses the same
positions, read from cos/sin tables [capacity, head_dim]: no per-call position or mask tensors.
In a packed prefill tile (`segments`) a row is a chunk of a prompt: up to S tokens from a token of its
own, at a start of its own.

Numerics: the q/k/v projection's output (parts or partial sums, added in order in fp32:
tts_kernels.linear), norm and RoPE are fp32; keys, values and queries are rounded once, to the
cache's dtype (in the engine the weights': fp16 or bf16). Scores and the online softmax are fp32; the probabilities meet the values
in the cache's dtype; the output is written as parts for the o projection.
"""
import torch
import triton
import triton.language as tl

from tts_kernels import compiled
from tts_kernels.launch import let_dependents_launch, programmatic, wait_for_predecessor
from tts_kernels.linear import load_parts, parts_of, store_parts


@triton.jit
def norm_and_rotate(x, x_partner, weight, weight_partner, first_half, cos, sin, eps, HEAD_DIM: tl.constexpr):
    """Head vectors x [..., D] RMS-normed (times weight) and rotated by RoPE (rotate-half: the
    partner of dimension i is i + D/2 for the first half, negated, else i - D/2); x_partner holds
    each dimension's partner value; weight, weight_partner, first_half, cos, sin broadcast to x.
    The last axis holds the head's dimensions (zeros past HEAD_DIM). Shared by the attention
    kernel (2-D tiles) and the persistent depth kernel (3-D)."""
    rstd = tl.expand_dims(1.0 / tl.sqrt(tl.sum(x * x, axis=len(x.shape) - 1) / HEAD_DIM + eps), len(x.shape) - 1)
    normed = weight * (x * rstd)
    normed_partner = weight_partner * (x_partner * rstd)
    return normed * cos + tl.where(first_half, -normed_partner, normed_partner) * sin


@triton.jit
def _rotated_heads(qkv_ptr, base, part_stride, valid, norm_ptr, cos_ptr, sin_ptr, pos, eps,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PARTS: tl.constexpr):
    """Head vectors [R, BLOCK_D] of the q/k/v projection's output at offsets base [R] (its parts
    summed; rows where valid), RMS-normed and rotated to positions pos [R]: fp32, zero past HEAD_DIM."""
    dims = tl.arange(0, BLOCK_D)
    half = HEAD_DIM // 2
    in_head = dims < HEAD_DIM
    partner = (dims + half) % HEAD_DIM            # rotate-half: [-x2, x1]
    mask = valid[:, None] & in_head[None, :]
    x = load_parts(qkv_ptr, base[:, None] + dims[None, :], part_stride, mask, PARTS)
    x_partner = load_parts(qkv_ptr, base[:, None] + partner[None, :], part_stride, mask, PARTS)
    weight = tl.load(norm_ptr + dims, mask=in_head, other=0.0).to(tl.float32)
    weight_partner = tl.load(norm_ptr + partner, mask=in_head, other=0.0).to(tl.float32)
    table = pos[:, None] * HEAD_DIM + dims[None, :]
    cos = tl.load(cos_ptr + table, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + table, mask=mask, other=0.0).to(tl.float32)
    return norm_and_rotate(x, x_partner, weight[None, :], weight_partner[None, :], (dims < half)[None, :], cos, sin,
                           eps, HEAD_DIM)


@triton.jit
def _queries(qkv_ptr, q_norm_ptr, cos_ptr, sin_ptr, first_token, count, kv_head, start, q_block, width, part_stride,
             eps, cache_type: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr,
             BLOCK_D: tl.constexpr, QKV_PARTS: tl.constexpr):
    """The tile of queries from entry q_block on (normed, rotated, in the cache's dtype), their
    positions, token and head per entry, and which entries are real: entry i is token i // GROUPS,
    head kv_head * GROUPS + i % GROUPS of the row's `count` tokens from token `first_token` on."""
    i = q_block + tl.arange(0, BLOCK_Q)
    valid = i < count * GROUPS
    q_token = first_token + i // GROUPS
    head = kv_head * GROUPS + i % GROUPS
    # padding entries look at key 0 only, so that no row of the tile is empty
    q_pos = tl.where(valid, start + i // GROUPS, start)
    q = _rotated_heads(qkv_ptr, q_token * width + head * HEAD_DIM, part_stride, valid, q_norm_ptr, cos_ptr,
                       sin_ptr, q_pos, eps, HEAD_DIM, BLOCK_D, QKV_PARTS).to(cache_type, fp_downcast_rounding="rtne")
    return q, q_pos, q_token, head, valid


@triton.jit
def _attend_block(q, q_pos, key_start, last, best, total, acc, k_cache_ptr, v_cache_ptr, head_base, scale,
                  cache_pos_stride, HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                  IEEE: tl.constexpr):
    """One step of the online softmax: the keys key_start .. key_start + BLOCK_K - 1 (those <= last)."""
    dims = tl.arange(0, BLOCK_D)
    keys = key_start + tl.arange(0, BLOCK_K)
    in_range = keys <= last
    kv_offsets = head_base + keys[:, None] * cache_pos_stride + dims[None, :]
    key_mask = in_range[:, None] & (dims < HEAD_DIM)[None, :]
    # the values' load issued with the keys', not after the scores: one memory round trip per step
    k = tl.load(k_cache_ptr + kv_offsets, mask=key_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_offsets, mask=key_mask, other=0.0)
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = tl.where(keys[None, :] <= q_pos[:, None], scores * scale, float("-inf"))
    new_best = tl.maximum(best, tl.max(scores, axis=1))
    p = tl.exp(scores - new_best[:, None])
    correction = tl.exp(best - new_best)
    total = total * correction + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v)
    return new_best, total, acc


@triton.jit
def _attend(q, q_pos, q_token, head, valid, k_cache_ptr, v_cache_ptr, head_base, last, out_ptr, out_part_stride,
            scale, cache_pos_stride, Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, CAPACITY: tl.constexpr,
            BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
            PARTS: tl.constexpr, STAGES: tl.constexpr):
    """A tile of queries against the cached keys at positions <= their own (online softmax over
    key steps of BLOCK_K), the output stored as parts. Compiled (STAGES > 0), a loop bounded by
    `last` whose loads Triton issues STAGES - 1 steps ahead; the interpreter's loop has a static
    trip count (one bounded by `last` breaks it under numpy 2.4) and skips the blocks past `last`.
    The same sums, in the same order, either way."""
    dims = tl.arange(0, BLOCK_D)
    best = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    if STAGES > 0:
        for key_start in tl.range(0, last + 1, BLOCK_K, num_stages=STAGES):
            best, total, acc = _attend_block(q, q_pos, key_start, last, best, total, acc, k_cache_ptr, v_cache_ptr,
                                             head_base, scale, cache_pos_stride, HEAD_DIM, BLOCK_K, BLOCK_D, IEEE)
    else:
        for key_start in range(0, CAPACITY, BLOCK_K):
            if key_start <= last:
                best, total, acc = _attend_block(q, q_pos, key_start, last, best, total, acc, k_cache_ptr,
                                                 v_cache_ptr, head_base, scale, cache_pos_stride, HEAD_DIM, BLOCK_K,
                                                 BLOCK_D, IEEE)
    out_offsets = (q_token * Q_HEADS + head)[:, None] * HEAD_DIM + dims[None, :]
    store_parts(out_ptr, out_offsets, out_part_stride, acc / total[:, None],
                valid[:, None] & (dims < HEAD_DIM)[None, :], PARTS)


@triton.jit
def _row_start_and_cache(rows_ptr, start_ptr, start, row, kv_head, cache_row_stride, cache_head_stride,
                         START_PER_ROW: tl.constexpr):
    """Where a row's new tokens go (its own start, or the one for all rows) and where its kv head's
    cache begins."""
    if START_PER_ROW:
        start = tl.load(start_ptr + row)
    cache_row = tl.load(rows_ptr + row)
    return start, cache_row * cache_row_stride + kv_head * cache_head_stride


@triton.jit
def _attention(qkv_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, rows_ptr, start_ptr,
               start, first_ptr, count_ptr, out_ptr, tokens, eps, scale, cache_row_stride, cache_head_stride,
               cache_pos_stride, Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUPS: tl.constexpr,
               HEAD_DIM: tl.constexpr, TOKENS_PER_ROW: tl.constexpr,
               CAPACITY: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_D: tl.constexpr, IEEE: tl.constexpr, QKV_PARTS: tl.constexpr, PARTS: tl.constexpr,
               START_PER_ROW: tl.constexpr, SEGMENTS: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    row_in_batch = tl.program_id(0)
    kv_head = tl.program_id(1)
    width = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    part_stride = tokens * width
    out_part_stride = tokens * Q_HEADS * HEAD_DIM
    let_dependents_launch(PDL)
    wait_for_predecessor(PDL)   # the positions and cache rows too may be written by the step before
    if SEGMENTS:   # the row's tokens: `count` (at most TOKENS_PER_ROW) from token `first_token` on
        first_token, count = tl.load(first_ptr + row_in_batch), tl.load(count_ptr + row_in_batch)
    else:
        first_token, count = row_in_batch * TOKENS_PER_ROW, TOKENS_PER_ROW
    start, head_base = _row_start_and_cache(rows_ptr, start_ptr, start, row_in_batch, kv_head, cache_row_stride,
                                            cache_head_stride, START_PER_ROW)
    cache_type: tl.constexpr = k_cache_ptr.dtype.element_ty
    # BLOCK_D >= 16 (what tl.dot needs); dimensions past HEAD_DIM are zeros
    dims = tl.arange(0, BLOCK_D)
    in_head = dims < HEAD_DIM

    # The first tile of queries (at the engine's shapes the only one) is read before the cache
    # writes below and their barrier, so that its loads overlap those of the new keys and values.
    q, q_pos, q_token, head, valid = _queries(qkv_ptr, q_norm_ptr, cos_ptr, sin_ptr, first_token, count, kv_head,
                                              start, 0, width, part_stride, eps, cache_type, GROUPS, HEAD_DIM,
                                              BLOCK_Q, BLOCK_D, QKV_PARTS)
    # the row's new keys (normed, rotated) and values into the cache
    t = tl.arange(0, BLOCK_S)
    t_valid = t < count
    token = first_token + t
    new_k = _rotated_heads(qkv_ptr, token * width + (Q_HEADS + kv_head) * HEAD_DIM, part_stride, t_valid, k_norm_ptr,
                           cos_ptr, sin_ptr, start + t, eps, HEAD_DIM, BLOCK_D, QKV_PARTS)
    kv_mask = t_valid[:, None] & in_head[None, :]
    new_v = load_parts(qkv_ptr, (token * width + (Q_HEADS + KV_HEADS + kv_head) * HEAD_DIM)[:, None] + dims[None, :],
                       part_stride, kv_mask, QKV_PARTS)
    slots = head_base + (start + t)[:, None] * cache_pos_stride + dims[None, :]
    tl.store(k_cache_ptr + slots, new_k.to(cache_type, fp_downcast_rounding="rtne"), mask=kv_mask)
    tl.store(v_cache_ptr + slots, new_v.to(cache_type, fp_downcast_rounding="rtne"), mask=kv_mask)
    tl.debug_barrier()   # the queries below read the keys just written, by other threads of this program

    last = start + count - 1     # the row's last new token sees the most keys
    _attend(q, q_pos, q_token, head, valid, k_cache_ptr, v_cache_ptr, head_base, last, out_ptr, out_part_stride,
            scale, cache_pos_stride, Q_HEADS, HEAD_DIM, CAPACITY, BLOCK_Q, BLOCK_K, BLOCK_D, IEEE, PARTS, STAGES)
    for q_block in tl.static_range(BLOCK_Q, TOKENS_PER_ROW * GROUPS, BLOCK_Q):
        q, q_pos, q_token, head, valid = _queries(qkv_ptr, q_norm_ptr, cos_ptr, sin_ptr, first_token, count, kv_head,
                                                  start, q_block, width, part_stride, eps, cache_type, GROUPS,
                                                  HEAD_DIM, BLOCK_Q, BLOCK_D, QKV_PARTS)
        _attend(q, q_pos, q_token, head, valid, k_cache_ptr, v_cache_ptr, head_base, last, out_ptr, out_part_stride,
                scale, cache_pos_stride, Q_HEADS, HEAD_DIM, CAPACITY, BLOCK_Q, BLOCK_K, BLOCK_D, IEEE, PARTS, STAGES)


@triton.jit
def _decode_attention(qkv_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, rows_ptr,
                      start_ptr, start, out_ptr, tokens, eps, scale, cache_row_stride, cache_head_stride,
                      cache_pos_stride, Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUPS: tl.constexpr,
                      HEAD_DIM: tl.constexpr, CAPACITY: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_D: tl.constexpr, QKV_PARTS: tl.constexpr, PARTS: tl.constexpr,
                      START_PER_ROW: tl.constexpr, PDL: tl.constexpr):
    """_attention for one new token per row, without the tensor cores: the GROUPS query heads of a
    kv head against its keys as broadcast products summed in fp32 (exact products of the rounded
    queries and keys, as the tensor cores make them; the sums in another order). The new key and
    value stay in registers, where _attention stores them and reads them back after a barrier: the
    softmax starts from the new key, and the cache's loads need not wait for this program's stores."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    width = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    part_stride = tokens * width   # one token per row: tokens = rows
    let_dependents_launch(PDL)
    wait_for_predecessor(PDL)   # as in _attention
    start, head_base = _row_start_and_cache(rows_ptr, start_ptr, start, row, kv_head, cache_row_stride,
                                            cache_head_stride, START_PER_ROW)
    cache_type: tl.constexpr = k_cache_ptr.dtype.element_ty
    dims = tl.arange(0, BLOCK_D)
    in_head = dims < HEAD_DIM
    group = tl.arange(0, BLOCK_G)
    one = tl.arange(0, 1)
    q = _rotated_heads(qkv_ptr, row * width + (kv_head * GROUPS + group) * HEAD_DIM, part_stride, group < GROUPS,
                       q_norm_ptr, cos_ptr, sin_ptr, start + 0 * group, eps, HEAD_DIM, BLOCK_D, QKV_PARTS)
    q = q.to(cache_type, fp_downcast_rounding="rtne").to(tl.float32)                           # [G, D]
    new_k = _rotated_heads(qkv_ptr, row * width + (Q_HEADS + kv_head) * HEAD_DIM + one, part_stride, one == 0,
                           k_norm_ptr, cos_ptr, sin_ptr, start + one, eps, HEAD_DIM, BLOCK_D, QKV_PARTS)
    v_base = row * width + (Q_HEADS + KV_HEADS + kv_head) * HEAD_DIM + one
    new_v = load_parts(qkv_ptr, v_base[:, None] + dims[None, :], part_stride, in_head[None, :], QKV_PARTS)   # [1, D]
    new_k = new_k.to(cache_type, fp_downcast_rounding="rtne")
    new_v = new_v.to(cache_type, fp_downcast_rounding="rtne")
    slot = head_base + (start + one)[:, None] * cache_pos_stride + dims[None, :]
    tl.store(k_cache_ptr + slot, new_k, mask=in_head[None, :])
    tl.store(v_cache_ptr + slot, new_v, mask=in_head[None, :])

    best = tl.sum(q * new_k.to(tl.float32), axis=1) * scale                                      # [G]
    total = tl.full([BLOCK_G], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32) + new_v.to(tl.float32)
    # the keys before the new one (a static trip count: see _attend)
    for key_start in range(0, CAPACITY, BLOCK_K):
        if key_start < start:
            keys = key_start + tl.arange(0, BLOCK_K)
            earlier = keys < start
            kv_offsets = head_base + keys[:, None] * cache_pos_stride + dims[None, :]
            k = tl.load(k_cache_ptr + kv_offsets, mask=earlier[:, None] & in_head[None, :], other=0.0)
            v = tl.load(v_cache_ptr + kv_offsets, mask=earlier[:, None] & in_head[None, :], other=0.0)
            scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale           # [G, K]
            scores = tl.where(earlier[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            p = tl.exp(scores - new_best[:, None])
            correction = tl.exp(best - new_best)
            total = total * correction + tl.sum(p, axis=1)
            p = p.to(cache_type).to(tl.float32)   # the probabilities meet the values in the cache's dtype
            acc = acc * correction[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            best = new_best
    out_offsets = ((row * Q_HEADS + kv_head * GROUPS + group) * HEAD_DIM)[:, None] + dims[None, :]
    store_parts(out_ptr, out_offsets, tokens * Q_HEADS * HEAD_DIM, acc / total[:, None],
                (group < GROUPS)[:, None] & in_head[None, :], PARTS)


def decode_block_k(rows: int, tokens_per_row: int, capacity: int) -> int:
    """Keys per step of the online softmax. One token per row against a long cache (the talker's
    decode step) takes wider steps: fewer of the chain's dependent loads. On the H200 at the 1.7B
    shapes (tools/attention_bench.py, docs/bench.md at 0bca9b7, 2026-12-02) 128 was fastest at 1 row
    and 64 at 64 rows; rows in between are not measured. Short caches (the code predictor's 16
    positions) and several tokens per row (the prefill) keep 32, where the wider steps did not win."""
    if tokens_per_row > 1 or capacity <= 32:
        return 32
    return 128 if rows <= 16 else 64


# _decode_attention's launch, and where it runs: one token per row against a short cache (the code
# predictor's 16 positions) from 64 rows. H200, 1.7B shapes (tools/attention_bench.py, 2026-12-04):
# 13.9 us against _attention's 24.3 at 512 rows, 5.9 against 6.6 at 64; against the talker's longer
# caches (positions 20-140), at 16 keys a step: 63.6 against 66.6 us at 512 rows, 36.2 against 36.2 at
# 256, 23.1 against 13.2 at 64 (one warp walks the keys; _attention takes 64 a step on the tensor cores).
DECODE_BLOCK_K, DECODE_WARPS, DECODE_MIN_ROWS, DECODE_MAX_CAPACITY = 8, 1, 64, 32


# The general kernel's key steps loaded one ahead (2 stages) for one token per row from 64 rows. H200,
# the 1.7B talker's shapes at positions 20-140 (tools/attention_bench.py, 2026-12-04): 58.7 us against
# 66.2 at 512 rows, 32.0 against 36.5 at 256, 11.7 against 13.0 at 64, the same outputs; 3 stages
# (72 KB of shared memory a program) 65.7 / 35.4 / 12.6. End to end +0.8% at c256 and c512 (docs/bench.md).
# Not measured: fewer rows, the prefill's tiles.
ATTENTION_STAGES, STAGES_MIN_ROWS = 2, 64


def attention_stages(rows: int, tokens_per_row: int) -> int:
    """The general kernel's `stages` where cached_attention is not told (the comment above)."""
    return ATTENTION_STAGES if tokens_per_row == 1 and rows >= STAGES_MIN_ROWS else 0


def takes_decode_kernel(rows: int, tokens_per_row: int, capacity: int) -> bool:
    """Whether cached_attention runs _decode_attention (where it measured faster: the comment above)."""
    return tokens_per_row == 1 and rows >= DECODE_MIN_ROWS and capacity <= DECODE_MAX_CAPACITY


def cached_attention(qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int, q_norm: torch.Tensor,
                     k_norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, rows: torch.Tensor, start: int | torch.Tensor, tokens_per_row: int,
                     scale: float, dtype: torch.dtype = torch.float32, block_k: int | None = None,
                     num_warps: int | None = None, decode: bool | None = None,
                     stages: int | None = None, segments: tuple[torch.Tensor, torch.Tensor] | None = None,
                     tokens: int | None = None) -> torch.Tensor:
    """qkv [Q * B * S, (q_heads + 2 kv_heads) * head_dim] fp32, Q >= 1 parts to add (one projection's
    output: its input's parts, or gemm_rows' partial sums; tts_kernels.linear) of B rows x S =
    tokens_per_row tokens;
    cos/sin tables [capacity, head_dim]; caches [R, kv_heads, capacity, head_dim]; rows [B]: each row's
    cache row; start: where each row's first token goes (module doc). Writes the new keys and values
    to the caches; returns the attention output [P * B * S, q_heads * head_dim] in dtype, as parts,
    for the o projection (over dtype weights). block_k: keys per step of the online softmax (by
    default decode_block_k's, DECODE_BLOCK_K in _decode_attention); num_warps: by default 4 up to 4
    tokens per row, else 8 (DECODE_WARPS); decode: whether _decode_attention runs (None: where
    takes_decode_kernel says; tools/attention_bench.py times the settings); stages: compiled, the
    general kernel's keys and values loaded that many steps ahead less one (0: a step's loads, then
    its products; None: attention_stages').
    segments (first [B], count [B]) and tokens: a packed prefill tile (tts_cli/engine/prefill.py) of
    `tokens` tokens, row b's being count[b] <= tokens_per_row of them from token first[b] on (a row of
    count 0 with start 0 writes and reads nothing); the output rows of other tokens are left unwritten."""
    s, rows = tokens_per_row, rows.contiguous()
    b = rows.shape[0]
    if segments is None and tokens not in (None, b * s):
        raise ValueError(f"{tokens} tokens in {b} rows of {s} need the rows' segments (a packed tile)")
    if segments is not None and (tokens is None or any(t.shape != rows.shape for t in segments)):
        raise ValueError(f"a packed tile needs its tokens and each of its {b} rows' first token and count")
    tokens = b * s if tokens is None else tokens
    groups = q_heads // kv_heads
    start_ptr, start_value = (start.contiguous(), 0) if torch.is_tensor(start) else (rows, start)
    first, count = (t.contiguous() for t in segments) if segments is not None else (rows, rows)
    parts, qkv_parts = parts_of(dtype), qkv.shape[0] // tokens
    if qkv.shape[0] != qkv_parts * tokens:
        raise ValueError(f"qkv has {qkv.shape[0]} rows: not a whole number of parts of {tokens} tokens")
    out = torch.empty(parts * tokens, q_heads * head_dim, device=qkv.device, dtype=dtype)
    if decode is None:
        decode = segments is None and takes_decode_kernel(b, s, k_cache.shape[2])
    args = (qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, rows, start_ptr, start_value)
    after = (out, tokens, eps, scale, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    shape = dict(Q_HEADS=q_heads, KV_HEADS=kv_heads, GROUPS=groups, HEAD_DIM=head_dim, CAPACITY=k_cache.shape[2],
                 BLOCK_D=max(16, triton.next_power_of_2(head_dim)), QKV_PARTS=qkv_parts, PARTS=parts,
                 START_PER_ROW=torch.is_tensor(start), **programmatic(qkv))
    if decode:
        if s != 1 or segments is not None:
            raise ValueError(f"_decode_attention takes one token per row, not {s} or a packed tile")
        _decode_attention[(b, kv_heads)](*args, *after, **shape, BLOCK_G=triton.next_power_of_2(groups),
                                         BLOCK_K=block_k or DECODE_BLOCK_K, num_warps=num_warps or DECODE_WARPS)
        return out
    _attention[(b, kv_heads)](
        *args, first, count, *after, **shape, SEGMENTS=segments is not None, TOKENS_PER_ROW=s,
        BLOCK_S=triton.next_power_of_2(s),
        BLOCK_Q=max(16, min(64, triton.next_power_of_2(s * groups))),
        BLOCK_K=block_k or decode_block_k(b, s, k_cache.shape[2]), IEEE=k_cache.dtype == torch.float32,
        STAGES=(attention_stages(b, s) if stages is None else stages) if compiled() else 0,
        # a prefill chunk's keys and queries spill at 4 warps (255 registers + stack at 32 tokens)
        num_warps=num_warps or (4 if s <= 4 else 8))
    return out
