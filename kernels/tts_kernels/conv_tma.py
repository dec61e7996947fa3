"""The vocoder's convolutions (tts_kernels.conv) as a Hopper kernel in Gluon: the input rows and
weight chunks come in by TMA through a ring of shared-memory stages, each chunk multiplied by one
asynchronous wgmma while the next ones are in flight; the epilogue is conv.py's (bias, residual,
stored output, SnakeBeta for the next convolution).

Why: in Triton 3.6 the 7-tap convolutions of 96 to 384 channels run at 186-360 TFLOP/s (the
loads are pointer gathers through the registers), and no other tile is faster (docs/bench.md at 0bca9b7,
2026-12-02). Here a chunk costs one TMA request per operand. At the tiles measured
for each width (TILES) it takes 8-23% off the 384- and 192-channel convolutions and the
transposed ones, 2-8% off the 96-channel ones; the 768-channel 7-tap ones stay in conv.py's
kernel (docs/bench.md at 0bca9b7, 2026-12-02).

An N block need not be a power of two: 96 columns run as two wgmmas of 64 and 32 (`split`) into
two accumulators, where a block of 128 would compute 32 padded columns.

The sums: over the taps in order, each tap's channels in chunks of BLOCK_K, each chunk one wgmma
(k16 steps in order), fp32 accumulation: the order of conv.py's kernel, whatever the two BLOCK_K
(the GPU test finds the two kernels' outputs bit-identical at four vocoder shapes). A
row's output does not depend on the other rows of its tile. Hopper (sm_90) only: there is no
interpreter for Gluon, so `fits` says where it can run and the caller keeps conv.py's kernel
everywhere else.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tts_kernels.conv import epilogue

EPILOGUE_ROWS = 32
MIN_FRAMES = 128


@gluon.jit
def _conv_tma(a_desc, w_desc, w2_desc, bias_ptr, res_ptr, out_ptr, snake_out_ptr, factors_ptr,
              frames, batch_rows, n_out, r_b, r_t, o_b, o_t, so_b, so_t,
              C_IN: gl.constexpr, TAPS: gl.constexpr, DILATION: gl.constexpr,
              RESIDUAL: gl.constexpr, OUT: gl.constexpr, SNAKE_OUT: gl.constexpr, SPLIT: gl.constexpr,
              STAGES: gl.constexpr, EPILOGUE_ROWS: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = a_desc.block_shape[0]
    BK: gl.constexpr = a_desc.block_shape[1]
    # SPLIT: the N block is w_desc's columns and then w2_desc's, each chunk two wgmmas (`split`)
    BN1: gl.constexpr = w_desc.block_shape[1]
    BN2: gl.constexpr = w2_desc.block_shape[1] if SPLIT else 0
    BN: gl.constexpr = BN1 + BN2
    SUMS_N: gl.constexpr = 2 * BN1 if SPLIT else BN1   # the epilogue's width: a power of two
    CHUNKS: gl.constexpr = C_IN // BK
    STEPS: gl.constexpr = TAPS * CHUNKS
    # Program order as conv.py's: the N blocks of one M block next to each other (same input rows in
    # L2); an M block is BM frames of one row of the batch, so that its taps are plain row offsets.
    n_blocks = gl.cdiv(n_out, BN)
    m_block = gl.program_id(0) // n_blocks
    n0 = (gl.program_id(0) % n_blocks) * BN
    per_row = gl.cdiv(frames, BM)
    b = m_block // per_row
    t0 = (m_block % per_row) * BM
    first_row = b * batch_rows + t0        # the flattened input row of tap 0's first frame

    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_shape, a_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_shape, w_desc.layout)
    if SPLIT:
        w2_smem = gl.allocate_shared_memory(w2_desc.dtype, [STAGES] + w2_desc.block_shape, w2_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    fence_async_shared()
    chunk_bytes: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes + \
        (w2_desc.block_type.nbytes if SPLIT else 0)

    for s in gl.static_range(STAGES - 1):
        if s < STEPS:
            mbarrier.expect(ready.index(s), chunk_bytes)
            tma.async_copy_global_to_shared(a_desc, [first_row + (s // CHUNKS) * DILATION, (s % CHUNKS) * BK],
                                            ready.index(s), a_smem.index(s))
            tma.async_copy_global_to_shared(w_desc, [(s // CHUNKS) * C_IN + (s % CHUNKS) * BK, n0],
                                            ready.index(s), w_smem.index(s))
            if SPLIT:
                tma.async_copy_global_to_shared(w2_desc, [(s // CHUNKS) * C_IN + (s % CHUNKS) * BK, n0 + BN1],
                                                ready.index(s), w2_smem.index(s))

    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN1, 16])
    acc = gl.zeros([BM, BN1], gl.float32, layout=acc_layout)
    if SPLIT:
        acc2_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                              instr_shape=[16, BN2, 16])
        acc2 = gl.zeros([BM, BN2], gl.float32, layout=acc2_layout)
    for i in range(STEPS):
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), phase=(i // STAGES) & 1)
        acc = warpgroup_mma(a_smem.index(slot), w_smem.index(slot), acc, is_async=True)
        # the products of step i - 1 are done after this: its stage takes step i + STAGES - 1
        if SPLIT:
            acc2 = warpgroup_mma(a_smem.index(slot), w2_smem.index(slot), acc2, is_async=True)
            acc, acc2 = warpgroup_mma_wait(num_outstanding=2, deps=[acc, acc2])
        else:
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
        ahead = i + STAGES - 1
        if ahead < STEPS:
            stage = ahead % STAGES
            mbarrier.expect(ready.index(stage), chunk_bytes)
            tma.async_copy_global_to_shared(a_desc, [first_row + (ahead // CHUNKS) * DILATION,
                                                     (ahead % CHUNKS) * BK], ready.index(stage), a_smem.index(stage))
            tma.async_copy_global_to_shared(w_desc, [(ahead // CHUNKS) * C_IN + (ahead % CHUNKS) * BK, n0],
                                            ready.index(stage), w_smem.index(stage))
            if SPLIT:
                tma.async_copy_global_to_shared(w2_desc, [(ahead // CHUNKS) * C_IN + (ahead % CHUNKS) * BK,
                                                          n0 + BN1], ready.index(stage), w2_smem.index(stage))
    if SPLIT:
        acc, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=[acc, acc2])
    else:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))

    # The epilogue in row chunks, through shared memory into a layout of whole row segments per
    # warp: in the wgmma layout a thread's 64-128 values each need their own 64-bit address, and
    # the SnakeBeta's temporaries on top of them took every register and spilled (sm_90, offline).
    sums = gl.allocate_shared_memory(gl.float32, [BM, SUMS_N], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    if SPLIT:
        sums.slice(0, BN1, dim=1).store(acc)
        sums.slice(BN1, BN2, dim=1).store(acc2)
    else:
        sums.store(acc)
    gl.thread_barrier()
    ACROSS: gl.constexpr = 32 if SUMS_N >= 128 else SUMS_N // 4     # threads of a warp along a row, 4 values each
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // ACROSS, ACROSS], [num_warps, 1], [1, 0])
    # the columns past BN (a split block's padding) are never stored: n_valid masks them
    n = n0 + gl.arange(0, SUMS_N, layout=gl.SliceLayout(0, rows_layout))
    n_valid = (n < n_out) & (n < n0 + BN)
    for r in gl.static_range(0, BM, EPILOGUE_ROWS):
        t = t0 + r + gl.arange(0, EPILOGUE_ROWS, layout=gl.SliceLayout(1, rows_layout))
        epilogue(sums.slice(r, EPILOGUE_ROWS, dim=0).load(rows_layout), b, t, n, t < frames, n_valid, n_out,
                 bias_ptr, res_ptr, out_ptr, snake_out_ptr, factors_ptr, r_b, r_t, o_b, o_t, so_b, so_t,
                 RESIDUAL, OUT, SNAKE_OUT, True)


def gluon_names_differ() -> str | None:
    """Why this Triton's Gluon would not compile the kernel, or None. It is written against Triton
    3.6's Gluon (the H200's); later releases renamed gl.thread_barrier (to gl.barrier) and the TMA
    load (to tma.async_load), the old load failing only once a kernel is compiled (3.9 here)."""
    if hasattr(gl, "thread_barrier") and not hasattr(tma, "async_load"):
        return None
    return (f"Triton {triton.__version__}'s Gluon names its barrier and TMA load otherwise than the 3.6 the "
            "kernel is written for")


def shared_layout(block: list[int]) -> gl.NVMMASharedLayout:
    """The shared-memory layout of an fp16 TMA tile, as wgmma reads it."""
    return gl.NVMMASharedLayout.get_default_for(block, gl.float16)


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) by input channels, the fastest of seven tiles on the
# H200 for the 1.7B vocoder's convolutions of 64 rows x 4 frames (docs/bench.md at 0bca9b7,
# 2026-12-02); for 96 and 192 channels, N blocks of 96 (64 + 32) in 4 warps: 6-15% less time than
# (128, 128, 32, 8, 4), (128, 64, 32, 4, 4) and 8 warps at 64, 128 and 256 rows (docs/bench.md, 2026-12-05).
# Not listed: the 7-tap convolutions of 768 channels and more, faster in conv.py's kernel.
TILES = {96: (128, 96, 32, 4, 4), 192: (128, 96, 32, 4, 4), 384: (64, 128, 64, 4, 3)}
TWO_TAP_TILES = {768: (64, 128, 32, 4, 4)}


def measured_tile(c_in: int, taps: int) -> tuple[int, int, int, int, int] | None:
    """The tile for a convolution of c_in channels and this many taps (the transposed ones run as
    two), or None where conv.py's kernel is faster or this one was not measured (the 1x1
    convolutions, bound by the bytes of their residual stream)."""
    if taps == 1:
        return None
    return TWO_TAP_TILES[c_in] if taps == 2 and c_in in TWO_TAP_TILES else TILES.get(c_in)


def tiles(c_in: int, n_out: int, taps: int) -> tuple[int, int, int, int, int]:
    """The measured tile, else a general one (for a caller that runs this kernel where `fits` says
    no, as the GPU test does)."""
    return measured_tile(c_in, taps) or (128, 128, 64 if c_in % 64 == 0 else 32, 4, 4)


def addressable(src: torch.Tensor, *weights: torch.Tensor) -> bool:
    """fp16 input rows and weights that TMA can address: 16-byte strides and addresses, the input's
    batch stride a whole number of frames, the weights contiguous."""
    c = src.shape[2]
    return (src.dtype == torch.float16 and src.stride(2) == 1 and src.stride(1) == c and src.stride(0) % c == 0
            and src.data_ptr() % 16 == 0
            and all(w.dtype == torch.float16 and w.is_contiguous() and w.data_ptr() % 16 == 0 for w in weights))


def fits(src: torch.Tensor, weight: torch.Tensor, frames: int) -> bool:
    """Whether this kernel takes the convolution (on sm_90: conv.tma_available): tensors TMA can
    address (`addressable`), more than one output channel, the channels a multiple of 32, shapes it
    has a measured tile for, and at least MIN_FRAMES frames per row (an M block holds one row's
    frames: the first two convolutions' 16 of a 4-frame window would leave 7/8 of it idle; conv.py's
    kernel packs the rows)."""
    c_in, n_out = src.shape[2], weight.shape[1]
    return (frames >= MIN_FRAMES and addressable(src, weight) and n_out > 1 and c_in % 32 == 0 and n_out % 8 == 0
            and measured_tile(c_in, weight.shape[0] // c_in) is not None)


def split(block_n: int) -> tuple[int, int]:
    """An N block as the columns of its two wgmmas: (block_n, 0) for a power of two, else the largest
    power of two below it and the rest (96 = 64 + 32: no padded columns), which must be one too."""
    first = 1 << (block_n.bit_length() - 1)
    second = block_n - first
    if second and (second & (second - 1) or second < 8):
        raise ValueError(f"an N block of {block_n} is not a power of two nor the sum of two (each at least 8)")
    return first, second


def conv_tma(src: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, frames: int, dilation: int, taps: int,
             strides: tuple[int, int, int, int, int, int], residual, out, snake, snake_out,
             tile: tuple[int, int, int, int, int] | None = None) -> None:
    """conv.causal_conv's contract (its checks done there): strides = (r_b, r_t, o_b, o_t, so_b, so_t)."""
    batch, length, c_in = src.shape
    n_out = weight.shape[1]
    block_m, block_n, block_k, warps, stages = tile or tiles(c_in, n_out, taps)
    if c_in % block_k:
        raise ValueError(f"a K chunk of {block_k} does not divide {c_in} input channels")
    # every frame of the buffer as a row, up to the last batch entry's last: TMA reads past it as zeros
    rows = src.as_strided(((batch - 1) * (src.stride(0) // c_in) + length, c_in), (c_in, 1))
    a_desc = TensorDescriptor.from_tensor(rows, [block_m, block_k], shared_layout([block_m, block_k]))
    first, second = split(block_n)
    w_desc = TensorDescriptor.from_tensor(weight, [block_k, first], shared_layout([block_k, first]))
    w2_desc = TensorDescriptor.from_tensor(weight, [block_k, second], shared_layout([block_k, second])) \
        if second else w_desc
    grid = (batch * triton.cdiv(frames, block_m) * triton.cdiv(n_out, block_n),)
    _conv_tma[grid](a_desc, w_desc, w2_desc, bias, residual if residual is not None else bias,
                    out if out is not None else bias, snake_out if snake_out is not None else bias,
                    snake if snake is not None else bias, frames, src.stride(0) // c_in, n_out, *strides,
                    C_IN=c_in, TAPS=taps, DILATION=dilation, RESIDUAL=residual is not None, OUT=out is not None,
                    SNAKE_OUT=snake_out is not None, SPLIT=second > 0, STAGES=stages, EPILOGUE_ROWS=EPILOGUE_ROWS,
                    num_warps=warps)
