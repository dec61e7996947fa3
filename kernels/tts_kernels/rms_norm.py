"""RMSNorm as one Triton kernel (torch takes ~8 kernels: cast, square, mean, add, rsqrt, multiply,
cast, multiply). The decode step is launch-bound.

Same rounding as the model's torch code: statistics in fp32, the normalized value rounded to x's
dtype, then multiplied by the weight and rounded to the output's dtype (x's; for fp32 x with bf16
weights nothing is rounded).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_rows(x_ptr, w_ptr, y_ptr, width, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < width
    out_type = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * width + cols, mask=valid, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
    # round to nearest even, as torch does
    normed = (x * rstd).to(out_type, fp_downcast_rounding="rtne").to(tl.float32)
    w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * width + cols, (w * normed).to(out_type, fp_downcast_rounding="rtne"), mask=valid)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x; the result has x's dtype."""
    width = x.shape[-1]
    rows = x.reshape(-1, width).contiguous()
    out = torch.empty_like(rows)
    _rms_norm_rows[(rows.shape[0],)](rows, weight, out, width, eps, BLOCK=triton.next_power_of_2(width))
    return out.view(x.shape)
