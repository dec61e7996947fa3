"""The codec's per-channel pointwise work as one Triton kernel: out = SnakeBeta(x + bias + residual),
each part optional, SnakeBeta(v) = v + sin^2(v * e^alpha) / (e^beta + eps).

The codec runs SnakeBeta 29 times per call on its largest activations, where torch's five
elementwise kernels each read and write the whole tensor; and cuDNN adds a convolution's bias as a
separate broadcast pass, which the next pointwise kernel can do on the way instead. Every
intermediate is rounded to the activation dtype as torch's ops round it, in torch's order: the
bias is added to the convolution's output, then the residual, then SnakeBeta."""
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from tts_kernels import compiled


@triton.jit
def _round(x, dtype: tl.constexpr):
    return x.to(dtype, fp_downcast_rounding="rtne").to(tl.float32)


@triton.jit
def _pointwise(x_ptr, bias_ptr, res_ptr, log_alpha_ptr, log_beta_ptr, out_ptr, channels, length,
               xs_b, xs_c, xs_t, rs_b, rs_c, rs_t, os_b, os_c, os_t, eps,
               BIAS: tl.constexpr, RESIDUAL: tl.constexpr, SNAKE: tl.constexpr,
               BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    row = tl.program_id(0)                     # b * channels + c
    b, c = row // channels, row % channels
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = t < length
    dtype = out_ptr.dtype.element_ty
    v = tl.load(x_ptr + b * xs_b + c * xs_c + t * xs_t, mask=valid, other=0.0).to(tl.float32)
    if BIAS:
        v = _round(v + tl.load(bias_ptr + c).to(tl.float32), dtype)
    if RESIDUAL:
        v = _round(v + tl.load(res_ptr + b * rs_b + c * rs_c + t * rs_t, mask=valid, other=0.0).to(tl.float32),
                   dtype)
    if SNAKE:
        # libdevice's exp, sin and division, like torch's: on the GPU tl.exp, tl.sin and '/' are
        # approximations, and one wrong per-channel factor changes a whole channel (measured on the
        # H200: 14% of bf16 results one unit off). The interpreter has no libdevice; it uses numpy's.
        log_alpha = tl.load(log_alpha_ptr + c).to(tl.float32)
        log_beta = tl.load(log_beta_ptr + c).to(tl.float32)
        if LIBDEVICE:
            alpha, beta = libdevice.exp(log_alpha), libdevice.exp(log_beta)
        else:
            alpha, beta = tl.exp(log_alpha), tl.exp(log_beta)
        alpha = _round(alpha, dtype)
        beta = _round(_round(beta, dtype) + eps, dtype)
        if LIBDEVICE:   # '/' on the GPU is an approximate division
            inv_beta = libdevice.div_rn(1.0, beta)
        else:
            inv_beta = 1.0 / beta
        inv_beta = _round(inv_beta, dtype)
        phase = _round(v * alpha, dtype)
        if LIBDEVICE:
            sin = libdevice.sin(phase)
        else:
            sin = tl.sin(phase)
        sin = _round(sin, dtype)
        square = _round(sin * sin, dtype)
        # Compiled for the GPU this rounding of the product is dropped (measured on the H200: the bf16
        # results equal torch's chain without it), so there v + inv_beta * square is rounded once.
        v = v + _round(inv_beta * square, dtype)
    tl.store(out_ptr + b * os_b + c * os_c + t * os_t, v.to(dtype, fp_downcast_rounding="rtne"), mask=valid)


def channel_pointwise(x: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                      snake: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, C, T] (any strides) -> SnakeBeta(x + bias[C] + residual[B, C, T]), parts optional;
    snake = (log_alpha [C], log_beta [C], eps). Written into `out` (any strides, e.g. a slice of a
    larger buffer) or a new contiguous tensor, which is returned."""
    batch, channels, length = x.shape
    if out is None:
        out = torch.empty(batch, channels, length, device=x.device, dtype=x.dtype)
    res = residual if residual is not None else x
    log_alpha, log_beta, eps = snake if snake is not None else (x, x, 0.0)
    block = min(1024, triton.next_power_of_2(length))
    _pointwise[(batch * channels, triton.cdiv(length, block))](
        x, bias if bias is not None else x, res, log_alpha, log_beta, out, channels, length,
        *x.stride(), *res.stride(), *out.stride(), eps,
        BIAS=bias is not None, RESIDUAL=residual is not None, SNAKE=snake is not None, BLOCK=block,
        LIBDEVICE=compiled())
    return out
