"""silu(gate) * up as one Triton kernel over the merged gate/up projection's output (torch: split
views, silu, multiply, each a kernel), reading and writing activations as parts (tts_kernels.linear):
the fp32 sum of the input's parts, the result as parts for the down projection. Where the gate/up
projection runs on the GEMV (one fp16 row) or on gemm_rows (2-64 fp16 rows), that kernel does it
itself (`project_silu`): one kernel fewer per layer."""
import torch
import triton
import triton.language as tl

from tts_kernels.launch import let_dependents_launch, programmatic, wait_for_predecessor
from tts_kernels.linear import (RowsTile, gemm_rows_fits, gemm_rows_launch, gemm_rows_sums, gemv_sums, gemv_tile,
                                load_parts, parts_of, project, rows_tile, store_parts, takes_gemv)


@triton.jit
def _silu_times(gate, up):
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _silu_mul(gate_up_ptr, out_ptr, rows, width, PARTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < width
    let_dependents_launch(PDL)
    wait_for_predecessor(PDL)
    gate = load_parts(gate_up_ptr, row * 2 * width + cols, rows * 2 * width, valid, PARTS)
    up = load_parts(gate_up_ptr, row * 2 * width + width + cols, rows * 2 * width, valid, PARTS)
    store_parts(out_ptr, row * width + cols, rows * width, _silu_times(gate, up), valid, PARTS)


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


@triton.jit
def _gemv_silu(x_ptr, w_ptr, out_ptr, I, K, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
               PDL: tl.constexpr):
    """out[i] = silu(gate[i]) * up[i] for BLOCK_I outputs, gate and up the GEMVs of w's rows i and
    I + i: the tile's rows interleave them (gate, up, gate, up, ...), so that one program has both."""
    j = tl.arange(0, 2 * BLOCK_I)
    i = tl.program_id(0) * BLOCK_I + j // 2
    sums = gemv_sums(x_ptr, w_ptr, i + (j % 2) * I, i < I, K, BLOCK_K, EVEN, PDL)
    gate, up = tl.split(tl.reshape(sums, (BLOCK_I, 2)))
    out = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    tl.store(out_ptr + out, _silu_times(gate, up).to(out_ptr.dtype.element_ty), mask=out < I)


def gemv_silu(x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
    """x [1, K] fp16 and gate_up_weight [2 I, K] (gate rows first) -> silu(x @ gate.T) * (x @ up.T)
    [1, I] fp16, in one kernel: the same sums as tts_kernels.linear.gemv, on its tile of weight
    rows (half of them gate rows, half the matching up rows)."""
    two_i, k = gate_up_weight.shape
    width = two_i // 2
    block_n, lanes, warps = gemv_tile(two_i, k)
    block_i = max(block_n // 2, 1)
    block_k = min(lanes, triton.next_power_of_2(k))
    out = torch.empty(1, width, device=x.device, dtype=x.dtype)
    _gemv_silu[(triton.cdiv(width, block_i),)](x, gate_up_weight, out, width, k, BLOCK_I=block_i, BLOCK_K=block_k,
                                               EVEN=width % block_i == 0 and k % block_k == 0, num_warps=warps,
                                               num_stages=3, **programmatic(x))
    return out


@triton.jit
def _gemm_rows_silu(x_ptr, w_ptr, out_ptr, M, I: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr, PDL: tl.constexpr):
    """out[m, i] = silu(gate[m, i]) * up[m, i] for every row m and BLOCK_I outputs, gate and up
    gemm_rows' sums over w's rows i and I + i, interleaved in the tile as in _gemv_silu."""
    j = tl.arange(0, 2 * BLOCK_I)
    i = tl.program_id(0) * BLOCK_I + j // 2
    sums = gemm_rows_sums(x_ptr, w_ptr, i + (j % 2) * I, M, K, 0, K, BLOCK_M, BLOCK_K, SWAP, PDL)
    gate, up = tl.split(tl.reshape(sums, (BLOCK_M, BLOCK_I, 2)))
    m = tl.arange(0, BLOCK_M)
    out = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    tl.store(out_ptr + m[:, None] * I + out[None, :], _silu_times(gate, up).to(out_ptr.dtype.element_ty),
             mask=m[:, None] < M)


# gemm_rows_silu's tile: narrower and shallower than rows_tile's (twice the programs, half the K
# chunk, one more stage). H200, the talker's gate/up [12288, 2048] at 64 rows in a CUDA-graph chain
# (tools/gemm_bench.py, docs/bench.md at 0bca9b7, 2026-12-01): 17.0 us against 20.6 on rows_tile's
# RowsTile(64) and 19.5 on cuBLAS then silu_mul.
SILU_TILE = RowsTile(32, block_k=64, stages=5)


def silu_tile(two_i: int, k: int) -> RowsTile:
    """gemm_rows_silu's tile for a gate/up weight [2 I, K]: SILU_TILE where it cuts the weight."""
    return SILU_TILE if two_i % SILU_TILE.block_n == 0 and k % SILU_TILE.block_k == 0 else rows_tile(two_i, k)


def gemm_rows_silu(x: torch.Tensor, gate_up_weight: torch.Tensor, tile: RowsTile | None = None) -> torch.Tensor:
    """x [M, K] fp16 (a few rows, as gemm_rows takes them) and gate_up_weight [2 I, K] (gate rows
    first) -> silu(x @ gate.T) * (x @ up.T) [M, I] fp16, in one kernel: gemm_rows' sums, on its
    tile of weight rows (half of them gate rows, half the matching up rows; whole sums, no slices)."""
    (rows, k), two_i = x.shape, gate_up_weight.shape[0]
    width = two_i // 2
    tile = tile or silu_tile(two_i, k)
    block_i = tile.block_n // 2
    if width % block_i or k % tile.block_k or tile.slices != 1:
        raise ValueError(f"{tile} does not cut a gate/up weight [{two_i}, {k}] into whole sums")
    out = torch.empty(rows, width, device=x.device, dtype=x.dtype)
    _gemm_rows_silu[(width // block_i,)](x, gate_up_weight, out, rows, width, k, BLOCK_I=block_i,
                                         **gemm_rows_launch(x, tile))
    return out


def project_silu(x_parts: torch.Tensor, gate_up_weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The down projection's input, silu(gate) * up of x_parts' gate/up projection (split's output
    for weights of `dtype`): by `gemv_silu` or `gemm_rows_silu` where `project` would run the GEMV or
    gemm_rows, else as silu_mul(project(...))."""
    if takes_gemv(x_parts, gate_up_weight):
        return gemv_silu(x_parts, gate_up_weight)
    if gemm_rows_fits(x_parts, gate_up_weight):
        return gemm_rows_silu(x_parts, gate_up_weight)
    return silu_mul(project(x_parts, gate_up_weight), dtype)
