"""The vocoder's convolutions in time-major layout ([B, T, C]) as one Triton kernel each, with
the pointwise work around them in the epilogue.

A causal convolution of `taps` taps and dilation d over a buffer [B, context + T, C_in] whose
first context = (taps - 1) * d frames are the history is an implicit GEMM: output frame t is
sum_k src[t + k * d] @ W[k], W [taps * C_in, N]. The codec's transposed convolutions are the same
GEMM (two taps, N = stride * C_out, an output row being `stride` samples side by side), and a
1x1 convolution is one tap. Time-major, the GEMM's rows are the frames and its K axis is the
channels, so nothing is transposed, concatenated or converted: in the channel-first layout cuDNN
reformatted every activation twice per convolution and the streamed histories were joined by copies.

The epilogue adds the bias, then optionally the residual, stores the result (`out`) and/or its
SnakeBeta (`snake_out`): the consumer's input, written straight after the consumer's history. The
SnakeBeta's factors e^alpha and 1 / (e^beta + eps) come from a table per output column, computed
once per convolution (`snake_factors`), not in every tile. Accumulation over K runs in a fixed
order that does not depend on the rows in the tile, so a row's output does not depend on its batch
mates.

On Hopper (sm_90) the convolutions of more than one tap run as tts_kernels.conv_tma's kernel
instead (TMA loads, wgmma; the same sums and epilogue), for the shapes it was measured faster on
and where TMA can address the tensors (`takes_tma`).

Precision: inputs and weights in fp16 (the engine's vocoder: fp16 tensor cores, fp32 accumulation
and epilogue, the residual stream (`residual`, `out`) in fp16 too, the waveform in fp32) or both
fp32 (TF32 when torch allows it for convolutions, its operands rounded to nearest, else exact;
the one-channel convolution's fp32 products never in TF32). Triton's TF32 GEMMs measured 2-4x
slower than cuDNN's on the H200, its fp16 ones 2-3x faster (docs/bench.md).
A value beyond fp16's range (65504) stored in an fp16 `snake_out` or `out` becomes an infinity,
and every later convolution turns it into infinities or NaN (SnakeBeta's sine of an infinity is
NaN), so it reaches the waveform: the caller finds it there (tts_cli.model.codec).
"""
import functools
import importlib

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from tts_kernels import compiled

# The interpreter runs a launch's programs one after another, each op a numpy call: few tall tiles
# (a sum over K runs in the same order at any BLOCK_M).
INTERPRETER_BLOCK_M = 1024
TWO_PI_HI = tl.constexpr(6.28125)        # 2 pi = hi + lo, hi with few bits: k * hi is exact
TWO_PI_LO = tl.constexpr(1.9353071795864769253e-3)


@triton.jit
def _sin(x, LIBDEVICE: tl.constexpr):
    """sin(x): on the GPU the hardware sine (libdevice's fast_sinf: sin.approx.f32) after reducing x
    to [-pi, pi] in two steps, absolute error ~1e-6; in the interpreter numpy's. tl.sin is libdevice's
    exact sinf, with a large-argument path through local memory: in this epilogue it took 13% of the
    vocoder's convolution time at 256 rows (docs/bench.md, 2026-12-04)."""
    if LIBDEVICE:
        k = libdevice.rint(x * 0.15915494309189535)
        return libdevice.fast_sinf((x - k * TWO_PI_HI) - k * TWO_PI_LO)
    else:
        return tl.sin(x)


@triton.jit
def _round_to_tf32(x):
    """fp32 x rounded to the nearest TF32 value (10 mantissa bits, ties away from zero). tl.dot hands
    its fp32 operands to the TF32 tensor cores unrounded; so the fp32 vocoder streamed 38.3 dB
    against the exact decode, and 49.2-50.8 with its operands rounded here (cuDNN's TF32
    convolutions: 50.9-51.2; H200, 2026-12-04, docs/numerics.md)."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _snake_factors(log_alpha_ptr, log_beta_ptr, factors_ptr, channels, n_out, eps, BLOCK: tl.constexpr,
                   LIBDEVICE: tl.constexpr):
    """factors [2, n_out]: e^alpha and 1 / (e^beta + eps) of channel n mod channels, with libdevice's
    exp and division, like torch's (on the GPU tl.exp and '/' are approximations); the interpreter
    has no libdevice and uses numpy's."""
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = n < n_out
    log_alpha = tl.load(log_alpha_ptr + n % channels, mask=valid, other=0.0)
    log_beta = tl.load(log_beta_ptr + n % channels, mask=valid, other=0.0)
    if LIBDEVICE:
        alpha, inv_beta = libdevice.exp(log_alpha), libdevice.div_rn(1.0, libdevice.exp(log_beta) + eps)
    else:
        alpha, inv_beta = tl.exp(log_alpha), 1.0 / (tl.exp(log_beta) + eps)
    tl.store(factors_ptr + n, alpha, mask=valid)
    tl.store(factors_ptr + n_out + n, inv_beta, mask=valid)


@triton.jit
def _snake_beta(v, alpha, inv_beta, LIBDEVICE: tl.constexpr):
    """SnakeBeta in fp32 with torch's order of operations: v + inv_beta * sin(v * alpha)^2."""
    sin = _sin(v * alpha, LIBDEVICE)
    return v + inv_beta * (sin * sin)


@triton.jit
def _causal_conv(src_ptr, weight_ptr, bias_ptr, res_ptr, out_ptr, snake_out_ptr, factors_ptr, rows, frames, n_out,
                 s_b, s_t, r_b, r_t, o_b, o_t, so_b, so_t,
                 C_IN: tl.constexpr, C_IN_PADDED: tl.constexpr, TAPS: tl.constexpr, DILATION: tl.constexpr,
                 RESIDUAL: tl.constexpr, OUT: tl.constexpr, SNAKE_OUT: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, N_BLOCKS: tl.constexpr,
                 PRECISION: tl.constexpr, ROUND_TF32: tl.constexpr, LIBDEVICE: tl.constexpr):
    # The N blocks of one M block are neighbours in launch order: they read the same input rows
    # while those are still in L2 (the last blocks' inputs are larger than L2).
    m = (tl.program_id(0) // N_BLOCKS) * BM + tl.arange(0, BM)      # (row, frame) pairs, rows one after the other
    n = (tl.program_id(0) % N_BLOCKS) * BN + tl.arange(0, BN)
    m_valid, n_valid = m < rows * frames, n < n_out
    b, t = m // frames, m % frames
    src_rows = src_ptr + b * s_b + t * s_t
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for i in range(0, TAPS * (C_IN_PADDED // BK)):
        tap = i // (C_IN_PADDED // BK)
        c = (i % (C_IN_PADDED // BK)) * BK + tl.arange(0, BK)   # a multiple of BK: aligned loads
        c_valid = c < C_IN
        a = tl.load(src_rows[:, None] + tap * DILATION * s_t + c[None, :],
                    mask=m_valid[:, None] & c_valid[None, :], other=0.0)
        w = tl.load(weight_ptr + (tap * C_IN + c)[:, None] * n_out + n[None, :],
                    mask=c_valid[:, None] & n_valid[None, :], other=0.0)
        if ROUND_TF32:
            a, w = _round_to_tf32(a), _round_to_tf32(w)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    epilogue(acc, b, t, n, m_valid, n_valid, n_out, bias_ptr, res_ptr, out_ptr, snake_out_ptr, factors_ptr,
             r_b, r_t, o_b, o_t, so_b, so_t, RESIDUAL, OUT, SNAKE_OUT, LIBDEVICE)


@triton.jit
def epilogue(acc, b, t, n, m_valid, n_valid, n_out, bias_ptr, res_ptr, out_ptr, snake_out_ptr, factors_ptr,
             r_b, r_t, o_b, o_t, so_b, so_t,
             RESIDUAL: tl.constexpr, OUT: tl.constexpr, SNAKE_OUT: tl.constexpr, LIBDEVICE: tl.constexpr):
    """The sums acc [len(t), len(n)] of frames t of batch entries b (each frame's, or one for all)
    and output channels n, written as the module doc says. One piece for this kernel and
    tts_kernels.conv_tma's (a Gluon kernel calls it with its tensors' layouts)."""
    valid = m_valid[:, None] & n_valid[None, :]
    v = acc + tl.load(bias_ptr + n, mask=n_valid, other=0.0)[None, :]
    if RESIDUAL:
        v += tl.load(res_ptr + (b * r_b + t * r_t)[:, None] + n[None, :], mask=valid, other=0.0).to(tl.float32)
    if OUT:
        tl.store(out_ptr + (b * o_b + t * o_t)[:, None] + n[None, :], v.to(out_ptr.dtype.element_ty), mask=valid)
    if SNAKE_OUT:
        alpha = tl.load(factors_ptr + n, mask=n_valid, other=0.0)[None, :]
        inv_beta = tl.load(factors_ptr + n_out + n, mask=n_valid, other=0.0)[None, :]
        v = _snake_beta(v, alpha, inv_beta, LIBDEVICE)
        tl.store(snake_out_ptr + (b * so_b + t * so_t)[:, None] + n[None, :], v.to(snake_out_ptr.dtype.element_ty),
                 mask=valid)


@triton.jit
def _sum_taps(partial_ptr, bias_ptr, out_ptr, rows, frames, p_b, o_b, TAPS: tl.constexpr, DILATION: tl.constexpr,
              COLUMNS: tl.constexpr, BM: tl.constexpr):
    """A convolution to one channel, its second half: output frame t = the sum over the taps, in
    order, of partial[t + tap * DILATION, tap] (input frame x tap weights, `to_one`), then + bias."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    m_valid = m < rows * frames
    b, t = m // frames, m % frames
    acc = tl.zeros([BM], dtype=tl.float32)
    for tap in tl.static_range(TAPS):
        acc += tl.load(partial_ptr + b * p_b + (t + tap * DILATION) * COLUMNS + tap, mask=m_valid, other=0.0)
    tl.store(out_ptr + b * o_b + t, acc + tl.load(bias_ptr), mask=m_valid)


def tiles(c_in: int, n_out: int, taps: int, half: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of a convolution. Chosen on the H200 from sweeps
    over every kind of the fp16 vocoder's convolutions at 64 rows x 4 frames (docs/bench.md at 0bca9b7,
    2026-11-30 and 2026-12-01): 64 x 64 tiles, 8 warps, 3 stages serve most (the 1x1 convolutions
    with the residual 1.5-1.6x faster than 128 x 64); 96 output channels take N blocks of 32 (none
    idle: 2.0-2.3x for the 1x1s) in M blocks of 128 (the 1x1s 7-12% less time than in 64 at 64, 128
    and 256 rows, 2026-12-05; the same sums, see INTERPRETER_BLOCK_M); the dilated 7-tap
    convolutions of 384 to 1024 channels take 128 x 128 (1.2-1.4x). K blocks of 64 where the
    channels allow."""
    block_k = 64 if half and c_in % 64 == 0 else 32
    block_k = max(16, min(block_k, triton.next_power_of_2(c_in)))
    if half and taps < 7 and n_out >= 1024:
        # the pre-convolution and the first transposed convolution, 16 frames a row (too few for
        # conv_tma's M blocks): 15-20% faster at 64 and 256 rows (docs/bench.md, 2026-12-04)
        return 128, 64, block_k, 4, 4
    if n_out == 96:
        return 128, 32, block_k, 4, 4
    if n_out <= 16:
        # the waveform convolution's first half (`to_one`): a stream of the input through one N block
        return 128, 16, block_k, 4, 3
    if taps == 7 and c_in in (384, 768, 1024):
        return 128, 128, block_k, 8, 3
    return 64, max(16, min(64, triton.next_power_of_2(n_out))), block_k, 8, 3


@functools.cache
def tma_available(device_index: int) -> tuple[bool, str]:
    """(True, "") when tts_kernels.conv_tma's kernel can run on this CUDA device, else (False, why)."""
    if torch.cuda.get_device_capability(device_index) != (9, 0):
        return False, f"{torch.cuda.get_device_name(device_index)} is not Hopper (sm_90)"
    try:
        conv_tma = importlib.import_module("tts_kernels.conv_tma")
    except ImportError as error:
        return False, f"this Triton has no Gluon ({error})"
    other_names = conv_tma.gluon_names_differ()
    return (False, other_names) if other_names else (True, "")


def takes_tma(src: torch.Tensor, weight: torch.Tensor, frames: int) -> bool:
    """Whether a convolution runs as tts_kernels.conv_tma's kernel: on sm_90 where it fits
    (conv_tma.fits: shapes it was measured faster on; the 1x1 convolutions stay here)."""
    if not (src.is_cuda and compiled() and tma_available(src.device.index)[0]):
        return False
    from tts_kernels import conv_tma
    return conv_tma.fits(src, weight, frames)


def _rows_view(x: torch.Tensor, frames: int, n: int, name: str) -> tuple[int, int]:
    """(batch stride, frame stride) of x [B, L, C] (fp32 or fp16) seen as [B, frames, n]: contiguous
    within each row (any batch stride), L * C = frames * n."""
    _, length, width = x.shape
    if x.dtype not in (torch.float32, torch.float16) or x.stride(2) != 1 or x.stride(1) != width \
            or length * width != frames * n:
        raise ValueError(f"{name} {list(x.shape)} ({x.dtype}, strides {x.stride()}) is not "
                         f"float32 or float16 [B, {frames}, {n}] contiguous within each row")
    return x.stride(0), n


def snake_factors(log_alpha: torch.Tensor, log_beta: torch.Tensor, eps: float, n_out: int) -> torch.Tensor:
    """A SnakeBeta's factors for `causal_conv`: [2, n_out] fp32, e^alpha and 1 / (e^beta + eps) of
    channel n mod len(log_alpha) (a transposed convolution's N is stride x its channels)."""
    factors = torch.empty(2, n_out, device=log_alpha.device, dtype=torch.float32)
    block = min(1024, triton.next_power_of_2(n_out))
    _snake_factors[(triton.cdiv(n_out, block),)](log_alpha.float().contiguous(), log_beta.float().contiguous(),
                                                 factors, log_alpha.shape[0], n_out, eps, BLOCK=block,
                                                 LIBDEVICE=compiled())
    return factors


def causal_conv(src: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, frames: int, dilation: int = 1,
                residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                snake: torch.Tensor | None = None, snake_out: torch.Tensor | None = None) -> None:
    """src [B, context + frames, C_in] (history first) and weight [taps * C_in, N], both fp16 or
    both fp32; bias [N] fp32. Writes out = conv + bias (+ residual) and/or snake_out = SnakeBeta(that)
    (snake: its factors [2, N] from `snake_factors`), residual, out and
    snake_out each fp32 or fp16 (the sums and the epilogue in fp32), each [B, frames, N] or the
    same memory seen as [B, frames * N / C, C] (a transposed convolution's samples), any batch
    stride; in an fp16 out or snake_out a value beyond fp16's range is an infinity (module doc). One
    output channel and only `out` (the waveform) runs as `_to_one`."""
    batch, _, c_in = src.shape
    n_out = weight.shape[1]
    taps = weight.shape[0] // c_in
    if weight.shape[0] != taps * c_in or src.shape[1] != (taps - 1) * dilation + frames:
        raise ValueError(f"src {list(src.shape)} does not fit weight {list(weight.shape)} with dilation "
                         f"{dilation} and {frames} frames")
    if src.dtype not in (torch.float16, torch.float32) or weight.dtype != src.dtype:
        raise ValueError(f"src and weight must be both float16 or both float32, got {src.dtype} and {weight.dtype}")
    if src.stride(2) != 1 or not weight.is_contiguous():
        raise ValueError("src must be contiguous along channels and weight contiguous")
    if out is None and snake_out is None:
        raise ValueError("nothing to write: give out and/or snake_out")
    factors_fit = snake is not None and snake.shape == (2, n_out) and snake.dtype == torch.float32 \
        and snake.is_contiguous()
    if (snake is None) != (snake_out is None) or (snake is not None and not factors_fit):
        raise ValueError(f"snake_out needs snake, the factors [2, {n_out}] float32 of snake_factors, and snake "
                         f"needs snake_out")
    largest = max(t.shape[0] * t.stride(0) for t in (src, residual, out, snake_out) if t is not None)
    if largest >= 2**31:   # the kernels' element offsets (row x batch stride + ...) are int32: they would wrap
        raise ValueError(f"{batch} rows of {largest // batch} elements: past the 2^31 elements that the "
                         "convolution kernels' int32 offsets address; use fewer rows (or a shorter codec window)")
    r_b, r_t = _rows_view(residual, frames, n_out, "residual") if residual is not None else (0, 0)
    o_b, o_t = _rows_view(out, frames, n_out, "out") if out is not None else (0, 0)
    so_b, so_t = _rows_view(snake_out, frames, n_out, "snake_out") if snake_out is not None else (0, 0)
    if n_out == 1 and residual is None and snake_out is None:
        _to_one(src, weight, bias, frames, dilation, out, o_b)
        return
    _gemm(src, weight, bias, frames, dilation, residual, out, snake, snake_out, (r_b, r_t, o_b, o_t, so_b, so_t),
          # TF32 exactly when torch would use it for a convolution (cuDNN's switch), the operands rounded to
          # nearest first (on the GPU: the interpreter's products are exact fp32); fp16 inputs ignore it.
          "tf32" if torch.backends.cudnn.allow_tf32 else "ieee")


def _gemm(src, weight, bias, frames, dilation, residual, out, snake, snake_out, strides, precision: str) -> None:
    """causal_conv's GEMM (its checks done there): conv_tma's kernel where it takes the shape, else conv.py's."""
    batch, _, c_in = src.shape
    n_out = weight.shape[1]
    taps = weight.shape[0] // c_in
    if takes_tma(src, weight, frames):
        from tts_kernels.conv_tma import conv_tma
        conv_tma(src, weight, bias, frames, dilation, taps, strides, residual, out, snake, snake_out)
        return
    block_m, block_n, block_k, warps, stages = tiles(c_in, n_out, taps, src.dtype == torch.float16)
    block_m = block_m if compiled() else INTERPRETER_BLOCK_M
    c_in_padded = triton.cdiv(c_in, block_k) * block_k
    n_blocks = triton.cdiv(n_out, block_n)
    _causal_conv[(triton.cdiv(batch * frames, block_m) * n_blocks,)](
        src, weight, bias, residual if residual is not None else bias, out if out is not None else bias,
        snake_out if snake_out is not None else bias, snake if snake is not None else bias, batch, frames, n_out,
        src.stride(0), src.stride(1), *strides,
        C_IN=c_in, C_IN_PADDED=c_in_padded, TAPS=taps, DILATION=dilation,
        RESIDUAL=residual is not None, OUT=out is not None, SNAKE_OUT=snake_out is not None,
        BM=block_m, BN=block_n, BK=block_k, N_BLOCKS=n_blocks, PRECISION=precision,
        ROUND_TF32=precision == "tf32" and src.dtype == torch.float32 and compiled(), LIBDEVICE=compiled(),
        num_warps=warps, num_stages=stages)


def _to_one(src, weight, bias, frames, dilation, out, o_b) -> None:
    """A convolution to one output channel (the waveform) in two launches: every input frame times
    the taps' weights side by side ([C_in, COLUMNS], one tap per column) as one GEMM, so each input
    value is read once, then each output frame's sum over its taps (`_sum_taps`). A one-channel GEMM
    tile would be 15/16 padding, and the CUDA-core kernel this replaces, reading the input once per
    tap, took ~5x the time of its bytes (docs/bench.md, 2026-12-04). fp32 inputs: IEEE fp32 products
    and sums (no TF32); fp16 inputs: exact products summed by the tensor cores' fp32 accumulation,
    which is not IEEE's (~1e-7 relative)."""
    batch, length, c_in = src.shape
    taps = weight.shape[0] // c_in
    columns = max(8, triton.next_power_of_2(taps))
    per_tap = torch.zeros(c_in, columns, dtype=weight.dtype, device=weight.device)
    per_tap[:, :taps] = weight.view(taps, c_in).t()
    partial = src.new_empty(batch, length, columns, dtype=torch.float32)
    no_bias = torch.zeros(columns, dtype=torch.float32, device=src.device)
    _gemm(src, per_tap, no_bias, length, 1, None, partial, None, None, (0, 0, length * columns, columns, 0, 0), "ieee")
    block_m = 1024 if compiled() else INTERPRETER_BLOCK_M
    _sum_taps[(triton.cdiv(batch * frames, block_m),)](partial, bias, out, batch, frames, length * columns, o_b,
                                                       TAPS=taps, DILATION=dilation, COLUMNS=columns, BM=block_m,
                                                       num_warps=4)
