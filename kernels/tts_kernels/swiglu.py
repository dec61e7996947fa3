"""silu(gate) * up as one Triton kernel over the merged gate/up projection's output (torch: split
views, silu, multiply, each a kernel). Rounding as torch: silu rounded, then the product."""
import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < width
    out_type = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=valid, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=valid, other=0.0).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(out_type, fp_downcast_rounding="rtne").to(tl.float32)
    tl.store(out_ptr + row * width + cols, (activated * up).to(out_type, fp_downcast_rounding="rtne"), mask=valid)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 * I] (gate first) -> silu(gate) * up [..., I]."""
    width = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * width).contiguous()
    out = torch.empty(rows.shape[0], width, device=rows.device, dtype=rows.dtype)
    block = 1024
    _silu_mul[(rows.shape[0], triton.cdiv(width, block))](rows, out, width, BLOCK=block)
    return out.view(*gate_up.shape[:-1], width)
