"""silu(gate) * up as one Triton kernel over the merged gate/up projection's output (torch: split
views, silu, multiply, each a kernel), reading and writing activations as parts (tts_kernels.linear):
the fp32 sum of the input's parts, the result as parts for the down projection."""
import torch
import triton
import triton.language as tl

from tts_kernels.launch import let_dependents_launch, programmatic, wait_for_predecessor
from tts_kernels.linear import load_parts, parts_of, store_parts


@triton.jit
def _silu_mul(gate_up_ptr, out_ptr, rows, width, PARTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < width
    let_dependents_launch(PDL)
    wait_for_predecessor(PDL)
    gate = load_parts(gate_up_ptr, row * 2 * width + cols, rows * 2 * width, valid, PARTS)
    up = load_parts(gate_up_ptr, row * 2 * width + width + cols, rows * 2 * width, valid, PARTS)
    store_parts(out_ptr, row * width + cols, rows * width, gate / (1.0 + tl.exp(-gate)) * up, valid, PARTS)


def silu_mul(gate_up: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """gate_up [..., 2 I] (gate first) -> silu(gate) * up [..., I] of gate_up's dtype; or, with
    `dtype` (the engine's projections, tts_kernels.linear), gate_up [P * M, 2 I] fp32, the output of a
    GEMM whose input had P = parts_of(dtype) parts -> the down projection's input [P * M, I] in dtype."""
    width = gate_up.shape[-1] // 2
    flat = gate_up.reshape(-1, 2 * width).contiguous()
    parts = 1 if dtype is None else parts_of(dtype)   # the input's and the output's
    rows = flat.shape[0] // parts
    out = torch.empty(parts * rows, width, device=flat.device, dtype=dtype or gate_up.dtype)
    block = 1024
    _silu_mul[(rows, triton.cdiv(width, block))](flat, out, rows, width, PARTS=parts, BLOCK=block,
                                                 **programmatic(flat))
    return out if dtype is not None else out.view(*gate_up.shape[:-1], width)
