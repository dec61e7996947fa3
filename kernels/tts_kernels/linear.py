"""Projections of fp32 activations over bf16 weights, at the cost of one pass over the weights.

The engine keeps activations in fp32 and the weights in bf16 (as the checkpoint stores them). A
bf16 GEMM would round its input to bf16 (~2^-9 relative error per projection: the talker's logits
then drift below the engine issue's cosine 0.9999 against the fp32 model). Instead, the input x of
every projection is written as PARTS = 2 bf16 halves, hi = bf16(x) and lo = bf16(x - hi), stacked
as twice the rows, multiplied by cuBLAS with fp32 output, and the halves summed by whatever reads
the result: x to ~16 significant bits. Decode GEMMs are bound by reading the weights, so twice the
rows cost little. With fp32 weights PARTS = 1: the input itself and an fp32 GEMM.

`split` writes the parts (with the residual add of the previous projection's parts and the RMSNorm
before this one folded in); `project` multiplies; the attention and SwiGLU kernels read and write
parts with `load_parts` / `store_parts`; `linear` is the round trip for a lone projection.
"""
import torch
import triton
import triton.language as tl


def parts_for(weight: torch.Tensor) -> int:
    return 2 if weight.dtype == torch.bfloat16 else 1


def parts_dtype(parts: int) -> torch.dtype:
    return torch.bfloat16 if parts == 2 else torch.float32


@triton.jit
def load_parts(ptr, offsets, part_stride, mask, PARTS: tl.constexpr):
    """The fp32 sum of the parts at ptr + offsets (part p is part_stride elements further)."""
    value = tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if PARTS == 2:
        value += tl.load(ptr + part_stride + offsets, mask=mask, other=0.0).to(tl.float32)
    return value


@triton.jit
def store_parts(ptr, offsets, part_stride, value, mask, PARTS: tl.constexpr):
    """fp32 value as PARTS parts: itself, or bf16 hi and the bf16 of what hi misses."""
    if PARTS == 2:
        hi = value.to(tl.bfloat16, fp_downcast_rounding="rtne")
        tl.store(ptr + offsets, hi, mask=mask)
        lo = (value - hi.to(tl.float32)).to(tl.bfloat16, fp_downcast_rounding="rtne")
        tl.store(ptr + part_stride + offsets, lo, mask=mask)
    else:
        tl.store(ptr + offsets, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split(x_ptr, delta_ptr, norm_ptr, out_ptr, rows, width, eps,
           ADD: tl.constexpr, DELTA_PARTS: tl.constexpr, NORM: tl.constexpr, PARTS: tl.constexpr,
           BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < width
    offsets = row * width + cols
    x = tl.load(x_ptr + offsets, mask=valid, other=0.0)
    if ADD:
        x += load_parts(delta_ptr, offsets, rows * width, valid, DELTA_PARTS)
        tl.store(x_ptr + offsets, x, mask=valid)
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
        x = tl.load(norm_ptr + cols, mask=valid, other=0.0).to(tl.float32) * (x * rstd)
    store_parts(out_ptr, offsets, rows * width, x, valid, PARTS)


def split(x: torch.Tensor, parts: int, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
          delta: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, D] fp32 -> [parts * M, D] (bf16 halves, or fp32 for parts = 1) of RMSNorm(x) (with
    norm_weight) or of x. delta [delta_parts * M, D] fp32, a projection's output: first added to x,
    in place (the residual add)."""
    rows, width = x.shape
    out = torch.empty(parts * rows, width, device=x.device, dtype=parts_dtype(parts))
    _split[(rows,)](x, delta if delta is not None else x, norm_weight if norm_weight is not None else x, out,
                    rows, width, eps, ADD=delta is not None,
                    DELTA_PARTS=1 if delta is None else delta.shape[0] // rows, NORM=norm_weight is not None,
                    PARTS=parts, BLOCK=triton.next_power_of_2(width))
    return out


def project(x_parts: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x_parts [P * M, K] (split's output) times weight.T: [P * M, N] fp32; the bias joins part 0."""
    if x_parts.dtype == torch.bfloat16:
        out = torch.mm(x_parts, weight.t(), out_dtype=torch.float32)
    else:
        out = x_parts @ weight.t()
    if bias is not None:
        out[:x_parts.shape[0] // parts_for(weight)] += bias
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 @ weight.T (+ bias) -> fp32 [..., N]."""
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()
    parts = parts_for(weight)
    out = project(split(rows, parts), weight, bias)
    if parts == 2:
        out = out[:rows.shape[0]] + out[rows.shape[0]:]
    return out.view(*x.shape[:-1], weight.shape[0])
