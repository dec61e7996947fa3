"""The codec transformer's streamed sliding-window attention as one Triton kernel per layer: RoPE
of the new queries and keys, attention over the row's cached window plus its new frames, and the
new frames written into the cache, in place. In torch the same is ~14 kernels (rotate-half with
cats, the cache gathered oldest first and joined to the new keys, the new frames scattered back,
two matmuls, mask and softmax).

Two kernels, one program per (row, head) in each: _window_attention on the tensor cores (the
queries padded to 16, every ring slot at once; 16 warps and ~76 KB of shared memory, so two
programs share an SM) and _window_attention_one_warp (few queries, the ring in steps of 8 slots, no
shared memory for operands: a dozen programs share an SM), which is faster from 64 rows of 4 frames
and much slower on one row's 16 (takes_one_warp_kernel).

The cache holds a row's last KEPT = window - 1 rotated keys and values as a ring, in the layout of
tts_cli.model.codec.SlidingWindowAttention's state: the key at position p in slot p % KEPT. Its T
new frames sit at positions start .. start + T - 1. A query at p sees keys at p - window + 1 .. p
that exist (position >= 0). Each kernel reads every slot, then after a barrier writes only the T new
frames' slots: those held the keys that leave the window, already in registers and consumed (moving
the window instead rewrote all KEPT entries: ~76 MB a layer at 64 rows, 59 us on the H200,
docs/bench.md).

Numerics: fp32 throughout; _window_attention's dot products in TF32 exactly when torch allows TF32
for matmuls (as the torch path would then run them), else exact fp32; the one-warp kernel's exact
fp32 either way.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _rotated(ptr, base, valid, cos, sin, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [R, BLOCK_D] at ptr + base[R] rotated by RoPE (rotate-half: x * cos + [-x2, x1] * sin);
    zeros past D."""
    d = tl.arange(0, BLOCK_D)
    partner = (d + D // 2) % D
    mask = valid[:, None] & (d < D)[None, :]
    x = tl.load(ptr + base[:, None] + d[None, :], mask=mask, other=0.0)
    x_partner = tl.load(ptr + base[:, None] + partner[None, :], mask=mask, other=0.0)
    return x * cos + tl.where((d < D // 2)[None, :], -x_partner, x_partner) * sin


@triton.jit
def _rope_rows(cos_ptr, sin_ptr, b, t, valid, cs_b, cs_t, d, in_head):
    """cos and sin [T, BLOCK_D] of row b's frames t (zeros where not valid, and past the head)."""
    rope = b * cs_b + t[:, None] * cs_t + d[None, :]
    mask = valid[:, None] & in_head
    return tl.load(cos_ptr + rope, mask=mask, other=0.0), tl.load(sin_ptr + rope, mask=mask, other=0.0)


@triton.jit
def _scores(q, keys, key_pos, key_valid, q_pos, scale, WINDOW: tl.constexpr, PRECISION: tl.constexpr):
    """Scaled scores [TQ, R] of queries at q_pos against keys [R, D] at key_pos; -inf where a
    query may not see the key."""
    s = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale
    distance = q_pos[:, None] - key_pos[None, :]
    visible = (distance >= 0) & (distance < WINDOW) & (key_pos >= 0)[None, :] & key_valid[None, :]
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _window_attention(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, cache_ptr, start_ptr, out_ptr, scale,
                      s_b, s_t, o_b, o_t, cs_b, cs_t, c_b, c_kv, c_h, c_p,
                      T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, KEPT: tl.constexpr,
                      WINDOW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KEPT: tl.constexpr,
                      BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(start_ptr + b)
    d = tl.arange(0, BLOCK_D)   # BLOCK_D >= 16, what tl.dot needs; dimensions past D are zeros
    in_head = (d < D)[None, :]
    t = tl.arange(0, BLOCK_T)
    t_valid = t < T
    cos, sin = _rope_rows(cos_ptr, sin_ptr, b, t, t_valid, cs_b, cs_t, d, in_head)
    rows = b * s_b + t * s_t + h * D
    q = _rotated(q_ptr, rows, t_valid, cos, sin, D, BLOCK_D)
    k_new = _rotated(k_ptr, rows, t_valid, cos, sin, D, BLOCK_D)
    v_new = tl.load(v_ptr + rows[:, None] + d[None, :], mask=t_valid[:, None] & in_head, other=0.0)
    q_pos = start + t

    # the ring: slot j holds the newest key before `start` at a position congruent to j
    keys_base = cache_ptr + b * c_b + h * c_h
    values_base = keys_base + c_kv
    j = tl.arange(0, BLOCK_KEPT)
    in_ring = j < KEPT
    slot_pos = start - KEPT + (j - start % KEPT + KEPT) % KEPT
    slots = j[:, None] * c_p + d[None, :]
    k_old = tl.load(keys_base + slots, mask=in_ring[:, None] & in_head, other=0.0)
    v_old = tl.load(values_base + slots, mask=in_ring[:, None] & in_head, other=0.0)

    s_old = _scores(q, k_old, slot_pos, in_ring, q_pos, scale, WINDOW, PRECISION)
    s_new = _scores(q, k_new, q_pos, t_valid, q_pos, scale, WINDOW, PRECISION)
    best = tl.maximum(tl.max(s_old, axis=1), tl.max(s_new, axis=1))
    p_old = tl.exp(s_old - best[:, None])
    p_new = tl.exp(s_new - best[:, None])
    total = tl.sum(p_old, axis=1) + tl.sum(p_new, axis=1)
    out = (tl.dot(p_old, v_old, input_precision=PRECISION) + tl.dot(p_new, v_new, input_precision=PRECISION)) \
        / total[:, None]
    out_rows = b * o_b + t * o_t + h * D
    tl.store(out_ptr + out_rows[:, None] + d[None, :], out, mask=t_valid[:, None] & in_head)

    tl.debug_barrier()   # every slot read above is consumed: now the new frames take theirs
    arriving = ((start + t) % KEPT)[:, None] * c_p + d[None, :]
    tl.store(keys_base + arriving, k_new, mask=t_valid[:, None] & in_head)
    tl.store(values_base + arriving, v_new, mask=t_valid[:, None] & in_head)


@triton.jit
def _window_attention_one_warp(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, cache_ptr, start_ptr, out_ptr, scale,
                               s_b, s_t, o_b, o_t, cs_b, cs_t, c_b, c_kv, c_h, c_p,
                               T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, KEPT: tl.constexpr,
                               WINDOW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr):
    """_window_attention in one warp, without the tensor cores: queries BLOCK_T at a time against
    the new frames, then the ring BLOCK_J slots at a time (online softmax), as broadcast products
    summed in fp32 (exact fp32, TF32 or not)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(start_ptr + b)
    d = tl.arange(0, BLOCK_D)
    in_head = (d < D)[None, :]
    keys_base = cache_ptr + b * c_b + h * c_h
    values_base = keys_base + c_kv
    # the call's new keys and values, every frame's
    n = tl.arange(0, BLOCK_N)
    n_valid = n < T
    cos, sin = _rope_rows(cos_ptr, sin_ptr, b, n, n_valid, cs_b, cs_t, d, in_head)
    new_rows = b * s_b + n * s_t + h * D
    k_new = _rotated(k_ptr, new_rows, n_valid, cos, sin, D, BLOCK_D)
    v_new = tl.load(v_ptr + new_rows[:, None] + d[None, :], mask=n_valid[:, None] & in_head, other=0.0)
    for t0 in tl.static_range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_valid = t < T
        cos, sin = _rope_rows(cos_ptr, sin_ptr, b, t, t_valid, cs_b, cs_t, d, in_head)
        q = _rotated(q_ptr, b * s_b + t * s_t + h * D, t_valid, cos, sin, D, BLOCK_D)
        # the new frames first: every query sees at least itself
        s = tl.sum(q[:, None, :] * k_new[None, :, :], axis=2) * scale
        s = tl.where((n[None, :] <= t[:, None]) & n_valid[None, :], s, float("-inf"))
        best = tl.max(s, axis=1)
        p = tl.exp(s - best[:, None])
        total = tl.sum(p, axis=1)
        acc = tl.sum(p[:, :, None] * v_new[None, :, :], axis=1)
        # then the ring, BLOCK_J slots at a time: slot j holds the newest key before `start` at a
        # position congruent to j
        for j0 in range(0, KEPT, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            in_ring = j < KEPT
            slot_pos = start - KEPT + (j - start % KEPT + KEPT) % KEPT
            slots = j[:, None] * c_p + d[None, :]
            k_old = tl.load(keys_base + slots, mask=in_ring[:, None] & in_head, other=0.0)
            v_old = tl.load(values_base + slots, mask=in_ring[:, None] & in_head, other=0.0)
            s_old = tl.sum(q[:, None, :] * k_old[None, :, :], axis=2) * scale
            visible = ((start + t)[:, None] - slot_pos[None, :] < WINDOW) & ((slot_pos >= 0) & in_ring)[None, :]
            s_old = tl.where(visible, s_old, float("-inf"))
            new_best = tl.maximum(best, tl.max(s_old, axis=1))
            p_old = tl.exp(s_old - new_best[:, None])
            correction = tl.exp(best - new_best)
            total = total * correction + tl.sum(p_old, axis=1)
            acc = acc * correction[:, None] + tl.sum(p_old[:, :, None] * v_old[None, :, :], axis=1)
            best = new_best
        out_rows = b * o_b + t * o_t + h * D
        tl.store(out_ptr + out_rows[:, None] + d[None, :], acc / total[:, None], mask=t_valid[:, None] & in_head)

    tl.debug_barrier()   # every slot read above is consumed: now the new frames take theirs
    arriving = ((start + n) % KEPT)[:, None] * c_p + d[None, :]
    tl.store(keys_base + arriving, k_new, mask=n_valid[:, None] & in_head)
    tl.store(values_base + arriving, v_new, mask=n_valid[:, None] & in_head)


# Where the one-warp kernel runs: the engine's codec calls of 4 frames from 64 rows. H200, the 1.7B
# codec's shapes, 8 layers graphed (2026-12-04, tools/attention_bench.py --codec-window's method): 157 us
# a layer against 240 at 512 rows, 83 against 122 at 256, 26 against 33 at 64; a 16-frame call at one
# row (the codec window there) 79 us against 6.1.
# Queries 4 and ring slots 8 at a time were fastest of seven tiles; two or four warps 1.4-3x slower.
ONE_WARP_MIN_ROWS, ONE_WARP_MAX_FRAMES, ONE_WARP_BLOCK_T, ONE_WARP_BLOCK_J = 64, 4, 4, 8


def takes_one_warp_kernel(rows: int, frames: int) -> bool:
    """Whether window_attention runs _window_attention_one_warp for calls of `frames` frames on `rows` rows."""
    return rows >= ONE_WARP_MIN_ROWS and frames <= ONE_WARP_MAX_FRAMES


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     cache: torch.Tensor, start: torch.Tensor, window: int,
                     one_warp: bool | None = None) -> torch.Tensor:
    """q, k, v [B, T, H * D] fp32 (the projections, before RoPE; views of one merged projection
    are fine: any batch and frame strides, the same for the three); cos/sin [B, T, D]; cache
    [B, 2, H, window - 1, D] (keys, values as a ring: module doc; updated in place); start [B]: each row's position of
    its first new frame. T <= window - 1. Returns the attention output [B, T, H * D]. one_warp:
    whether _window_attention_one_warp runs (None: where takes_one_warp_kernel says)."""
    batch, frames, width = q.shape
    _, _, heads, kept, head_dim = cache.shape
    if frames > kept or kept != window - 1 or width != heads * head_dim:
        raise ValueError(f"{frames} frames of width {width} do not fit a window cache {list(cache.shape)}")
    if any(x.stride() != q.stride() or x.stride(2) != 1 for x in (k, v)) or q.stride(2) != 1:
        raise ValueError("q, k and v must share their strides, contiguous along the channels")
    cos, sin = cos.contiguous(), sin.contiguous()
    out = q.new_empty(batch, frames, width)
    args = (q, k, v, cos, sin, cache, start.contiguous(), out, head_dim ** -0.5,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), cos.stride(0), cos.stride(1),
            cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3))
    shape = dict(T=frames, H=heads, D=head_dim, KEPT=kept, WINDOW=window)
    if one_warp is None:
        one_warp = takes_one_warp_kernel(batch, frames)
    if one_warp:
        _window_attention_one_warp[(batch, heads)](
            *args, **shape, BLOCK_T=ONE_WARP_BLOCK_T, BLOCK_N=triton.next_power_of_2(frames), BLOCK_J=ONE_WARP_BLOCK_J,
            BLOCK_D=triton.next_power_of_2(head_dim), num_warps=1)
        return out
    precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    _window_attention[(batch, heads)](
        *args, **shape, BLOCK_T=max(16, triton.next_power_of_2(frames)),
        BLOCK_KEPT=triton.next_power_of_2(kept), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        # 4 warps spill at the real shapes (tools/sm90_compile.py window); 8 fit (250 registers), untimed
        PRECISION=precision, num_warps=16)
    return out
