"""RMSNorm as one Triton kernel (torch takes ~8 kernels: cast, square, mean, add, rsqrt, multiply,
cast, multiply), optionally fused with the residual add before it. The decode step is
launch-bound, and a decoder layer adds and normalizes twice.

Same rounding as the model's torch code: the residual sum rounded to the activation dtype,
statistics in fp32, the normalized value rounded, then multiplied by the weight and rounded again.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_rows(x_ptr, delta_ptr, w_ptr, y_ptr, sum_ptr, width, eps, ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < width
    out_type = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * width + cols, mask=valid, other=0.0).to(tl.float32)
    if ADD:
        delta = tl.load(delta_ptr + row * width + cols, mask=valid, other=0.0).to(tl.float32)
        x = (x + delta).to(out_type, fp_downcast_rounding="rtne")
        tl.store(sum_ptr + row * width + cols, x, mask=valid)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
    # round to nearest even, as torch does
    normed = (x * rstd).to(out_type, fp_downcast_rounding="rtne").to(tl.float32)
    w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * width + cols, (w * normed).to(out_type, fp_downcast_rounding="rtne"), mask=valid)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x (weight has x's dtype)."""
    width = x.shape[-1]
    rows = x.reshape(-1, width).contiguous()
    out = torch.empty_like(rows)
    _rms_norm_rows[(rows.shape[0],)](rows, rows, weight, out, out, width, eps, ADD=False,
                                     BLOCK=triton.next_power_of_2(width))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + delta, RMSNorm(x + delta)): a residual add and the norm that follows it."""
    width = x.shape[-1]
    rows, deltas = x.reshape(-1, width).contiguous(), delta.reshape(-1, width).contiguous()
    total, out = torch.empty_like(rows), torch.empty_like(rows)
    _rms_norm_rows[(rows.shape[0],)](rows, deltas, weight, out, total, width, eps, ADD=True,
                                     BLOCK=triton.next_power_of_2(width))
    return total.view(x.shape), out.view(x.shape)
