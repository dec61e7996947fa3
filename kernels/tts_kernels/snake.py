"""SnakeBeta, x + sin^2(x * e^alpha) / (e^beta + eps) per channel, as one Triton kernel. The codec
runs it 29 times per call on its largest activations, where torch's five elementwise kernels
each read and write the whole tensor. Every intermediate is rounded to the activation dtype as
torch's ops round it."""
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from tts_kernels import compiled


@triton.jit
def _snake(x_ptr, log_alpha_ptr, log_beta_ptr, out_ptr, channels, length, stride_b, stride_c, stride_t, eps,
           BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    row = tl.program_id(0)                     # b * channels + c
    b, c = row // channels, row % channels
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = t < length
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + b * stride_b + c * stride_c + t * stride_t, mask=valid, other=0.0).to(tl.float32)
    # libdevice's exp, sin and division, like torch's: on the GPU tl.exp, tl.sin and '/' are
    # approximations, and one wrong per-channel factor changes a whole channel (measured on the
    # H200: 14% of bf16 results one unit off). The interpreter has no libdevice; it uses numpy's.
    log_alpha = tl.load(log_alpha_ptr + c).to(tl.float32)
    log_beta = tl.load(log_beta_ptr + c).to(tl.float32)
    if LIBDEVICE:
        alpha, beta = libdevice.exp(log_alpha), libdevice.exp(log_beta)
    else:
        alpha, beta = tl.exp(log_alpha), tl.exp(log_beta)
    alpha = alpha.to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    beta = beta.to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    beta = (beta + eps).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    if LIBDEVICE:   # '/' on the GPU is an approximate division
        inv_beta = libdevice.div_rn(1.0, beta)
    else:
        inv_beta = 1.0 / beta
    inv_beta = inv_beta.to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    phase = (x * alpha).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    if LIBDEVICE:
        sin = libdevice.sin(phase)
    else:
        sin = tl.sin(phase)
    sin = sin.to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    square = (sin * sin).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    # Compiled for the GPU this rounding of the product is dropped (measured on the H200: the bf16
    # results equal torch's chain without it), so there x + inv_beta * square is rounded once.
    term = (inv_beta * square).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    tl.store(out_ptr + row * length + t, (x + term).to(dtype, fp_downcast_rounding="rtne"), mask=valid)


def snake(x: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor, eps: float) -> torch.Tensor:
    """x [B, C, T] (any strides) -> SnakeBeta(x), contiguous."""
    batch, channels, length = x.shape
    out = torch.empty(batch, channels, length, device=x.device, dtype=x.dtype)
    block = min(1024, triton.next_power_of_2(length))
    _snake[(batch * channels, triton.cdiv(length, block))](
        x, log_alpha, log_beta, out, channels, length, x.stride(0), x.stride(1), x.stride(2), eps, BLOCK=block,
        LIBDEVICE=compiled())
    return out
