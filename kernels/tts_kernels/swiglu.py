"""silu(gate) * up as one Triton kernel over the merged gate/up projection's output (torch: split
views, silu, multiply, each a kernel), reading and writing activations as parts (tts_kernels.linear):
the fp32 sum of the input's parts, the result as parts for the down projection."""
import torch
import triton
import triton.language as tl

from tts_kernels.linear import load_parts, parts_dtype, store_parts


@triton.jit
def _silu_mul(gate_up_ptr, out_ptr, rows, width, IN_PARTS: tl.constexpr, OUT_PARTS: tl.constexpr,
              BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < width
    gate = load_parts(gate_up_ptr, row * 2 * width + cols, rows * 2 * width, valid, IN_PARTS)
    up = load_parts(gate_up_ptr, row * 2 * width + width + cols, rows * 2 * width, valid, IN_PARTS)
    store_parts(out_ptr, row * width + cols, rows * width, gate / (1.0 + tl.exp(-gate)) * up, valid, OUT_PARTS)


def silu_mul(gate_up: torch.Tensor, in_parts: int = 1, out_parts: int = 1) -> torch.Tensor:
    """gate_up [in_parts * M, 2 I] (gate first; or [..., 2 I] with one part) -> silu(gate) * up as
    [out_parts * M, I] (bf16 halves for 2 parts; one part: gate_up's dtype, [..., I])."""
    width = gate_up.shape[-1] // 2
    flat = gate_up.reshape(-1, 2 * width).contiguous()
    rows = flat.shape[0] // in_parts
    dtype = parts_dtype(out_parts) if out_parts == 2 else gate_up.dtype
    out = torch.empty(out_parts * rows, width, device=flat.device, dtype=dtype)
    block = 1024
    _silu_mul[(rows, triton.cdiv(width, block))](flat, out, rows, width, IN_PARTS=in_parts, OUT_PARTS=out_parts,
                                                  BLOCK=block)
    return out if in_parts > 1 or out_parts > 1 else out.view(*gate_up.shape[:-1], width)
