"""The attention half of a decoder layer for a few new tokens per row against a static KV cache,
as two Triton kernels (torch takes ~25 small kernels: views, two RMSNorms, rotate-half RoPE, cache
scatter, two batched matmuls, scale, mask, softmax, casts).

`rope_and_store`: per new token, q and k heads RMS-normed and rotated, k and v written to the
cache at the token's position; returns the rotated queries.
`cached_attention`: each query attends to the cached keys at positions <= its own (causal by
position: the caller's keys beyond a row's position are stale or empty and never read).

A row's S new tokens go to cache positions start, start + 1, ...: `start` is one int for every row
(the code predictor, a prefill chunk) or a [B] tensor (the talker step). RoPE uses the same
positions, read from cos/sin tables [capacity, head_dim]: no per-call position or mask tensors.

Numerics: the q/k/v projection's output (parts, summed in fp32: tts_kernels.linear) and norm and
RoPE are fp32; keys, values and queries are rounded once, to the cache's dtype (bf16 in the
engine). Scores and the online softmax are fp32; the probabilities meet the values in the cache's
dtype; the output is written as parts for the o projection.
"""
import torch
import triton
import triton.language as tl

from tts_kernels.linear import load_parts, parts_dtype, store_parts


@triton.jit
def _rope_and_store(qkv_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
                    rows_ptr, start_ptr, start, q_out_ptr, tokens, tokens_per_row, eps,
                    cache_row_stride, cache_head_stride, cache_pos_stride,
                    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PARTS: tl.constexpr,
                    START_PER_ROW: tl.constexpr):
    token = tl.program_id(0)          # b * tokens_per_row + s
    head = tl.program_id(1)           # 0..Q_HEADS-1: a query head; then the kv heads
    row_in_batch = token // tokens_per_row
    if START_PER_ROW:
        start = tl.load(start_ptr + row_in_batch)
    pos = start + token % tokens_per_row
    dims = tl.arange(0, HEAD_DIM)
    half = HEAD_DIM // 2
    partner = (dims + half) % HEAD_DIM            # rotate-half: [-x2, x1]
    width = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    is_query = head < Q_HEADS
    if is_query:
        norm_ptr = q_norm_ptr
    else:
        norm_ptr = k_norm_ptr
    base = token * width + head * HEAD_DIM
    x = load_parts(qkv_ptr, base + dims, tokens * width, dims < HEAD_DIM, PARTS)
    x_partner = load_parts(qkv_ptr, base + partner, tokens * width, dims < HEAD_DIM, PARTS)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
    normed = tl.load(norm_ptr + dims).to(tl.float32) * (x * rstd)
    normed_partner = tl.load(norm_ptr + partner).to(tl.float32) * (x_partner * rstd)
    rotated = tl.where(dims < half, -normed_partner, normed_partner)
    cos = tl.load(cos_ptr + pos * HEAD_DIM + dims).to(tl.float32)
    sin = tl.load(sin_ptr + pos * HEAD_DIM + dims).to(tl.float32)
    out = normed * cos + rotated * sin
    if is_query:
        q_type = q_out_ptr.dtype.element_ty
        tl.store(q_out_ptr + (token * Q_HEADS + head) * HEAD_DIM + dims, out.to(q_type, fp_downcast_rounding="rtne"))
    else:
        kv_head = head - Q_HEADS
        row = tl.load(rows_ptr + row_in_batch)
        slot = row * cache_row_stride + kv_head * cache_head_stride + pos * cache_pos_stride
        cache_type = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + slot + dims, out.to(cache_type, fp_downcast_rounding="rtne"))
        v = load_parts(qkv_ptr, token * width + (Q_HEADS + KV_HEADS + kv_head) * HEAD_DIM + dims, tokens * width,
                       dims < HEAD_DIM, PARTS)
        tl.store(v_cache_ptr + slot + dims, v.to(cache_type, fp_downcast_rounding="rtne"))


def _start(start: int | torch.Tensor, rows: torch.Tensor):
    """(pointer, value): the kernel arguments for a start position, a [B] tensor or an int (the
    pointer is unused then; START_PER_ROW = torch.is_tensor(start) says which)."""
    if torch.is_tensor(start):
        return start.contiguous(), 0
    return rows, start


def rope_and_store(qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int, q_norm: torch.Tensor,
                   k_norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, rows: torch.Tensor, start: int | torch.Tensor, tokens_per_row: int,
                   parts: int = 1) -> torch.Tensor:
    """qkv [parts * B * S, (q_heads + 2 kv_heads) * head_dim] fp32 (one projection's output, as
    parts: tts_kernels.linear) of B rows x S = tokens_per_row tokens; cos/sin tables [capacity, head_dim];
    caches [R, kv_heads, capacity, head_dim]; rows [B]: each row's cache row; start: where each row's
    first token goes (module doc). Returns the rotated queries [B, S, q_heads, head_dim] in the
    cache's dtype (attention meets them with the cached keys)."""
    s, rows = tokens_per_row, rows.contiguous()
    b = rows.shape[0]
    start_ptr, start_value = _start(start, rows)
    q = torch.empty(b, s, q_heads, head_dim, device=qkv.device, dtype=k_cache.dtype)
    _rope_and_store[(b * s, q_heads + kv_heads)](
        qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, rows, start_ptr, start_value, q, b * s, s, eps,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        Q_HEADS=q_heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, PARTS=parts, START_PER_ROW=torch.is_tensor(start))
    return q


@triton.jit
def _cached_attention(q_ptr, k_cache_ptr, v_cache_ptr, rows_ptr, start_ptr, start, out_ptr, tokens, tokens_per_row,
                      scale,
                      cache_row_stride, cache_head_stride, cache_pos_stride,
                      Q_HEADS: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, CAPACITY: tl.constexpr,
                      BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
                      PARTS: tl.constexpr, START_PER_ROW: tl.constexpr):
    row_in_batch = tl.program_id(0)
    kv_head = tl.program_id(1)
    # The queries of one kv head's GROUPS query heads for every new token of the row, as one tile:
    # entry i is token i // GROUPS, head kv_head * GROUPS + i % GROUPS.
    i = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    valid = i < tokens_per_row * GROUPS
    token = row_in_batch * tokens_per_row + i // GROUPS
    head = kv_head * GROUPS + i % GROUPS
    # BLOCK_D >= 16 (what tl.dot needs); dimensions past HEAD_DIM load as zeros
    dims = tl.arange(0, BLOCK_D)
    in_head = dims < HEAD_DIM
    q_offsets = (token * Q_HEADS + head)[:, None] * HEAD_DIM + dims[None, :]
    q_mask = valid[:, None] & in_head[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
    # padding entries look at key 0 only, so that no row of the tile is empty
    if START_PER_ROW:
        start = tl.load(start_ptr + row_in_batch)
    q_pos = tl.where(valid, start + i // GROUPS, start)
    last = start + tokens_per_row - 1     # the row's last new token sees the most keys
    cache_row = tl.load(rows_ptr + row_in_batch)
    head_base = cache_row * cache_row_stride + kv_head * cache_head_stride
    best = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    # A static trip count (a loop bounded by `last` breaks Triton's interpreter under numpy 2.4);
    # the blocks past `last` are skipped.
    for start in range(0, CAPACITY, BLOCK_K):
        if start <= last:
            keys = start + tl.arange(0, BLOCK_K)
            in_range = keys <= last
            kv_offsets = head_base + keys[:, None] * cache_pos_stride + dims[None, :]
            kv_mask = in_range[:, None] & in_head[None, :]
            k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(keys[None, :] <= q_pos[:, None], scores * scale, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            p = tl.exp(scores - new_best[:, None])
            correction = tl.exp(best - new_best)
            total = total * correction + tl.sum(p, axis=1)
            v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
            if IEEE:
                acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v)
            best = new_best
    store_parts(out_ptr, q_offsets, tokens * Q_HEADS * HEAD_DIM, acc / total[:, None], q_mask, PARTS)


def cached_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                     start: int | torch.Tensor, scale: float, parts: int = 1) -> torch.Tensor:
    """q [B, S, q_heads, head_dim] in the caches' dtype; caches [R, kv_heads, capacity, head_dim];
    rows [B]; start: the cache position of each row's first new token (module doc; each query
    sees the keys at cache positions <= its own).
    Returns [parts * B * S, q_heads * head_dim] as parts (tts_kernels.linear), for the o projection."""
    b, s, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    groups = q_heads // kv_heads
    block_q = max(16, min(64, triton.next_power_of_2(s * groups)))
    out = torch.empty(parts * b * s, q_heads * head_dim, device=q.device, dtype=parts_dtype(parts))
    grid = (b, kv_heads, triton.cdiv(s * groups, block_q))
    _cached_attention[grid](
        q.contiguous(), k_cache, v_cache, rows.contiguous(), *_start(start, rows), out, b * s, s, scale,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        Q_HEADS=q_heads, GROUPS=groups, HEAD_DIM=head_dim, CAPACITY=k_cache.shape[2], BLOCK_Q=block_q, BLOCK_K=32,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), IEEE=q.dtype == torch.float32, PARTS=parts,
        START_PER_ROW=torch.is_tensor(start))
    return out
