"""Projections of fp32 activations over 16-bit weights, at the cost of one pass over the weights.

The engine keeps activations in fp32; a projection's input is written in its weights' dtype, the
GEMM runs on the tensor cores with fp32 output. How many "parts" that input takes depends on it:
- fp16 weights (the engine's default on CUDA: the checkpoint's bf16 values, converted: exact
  down to 2^-17 in magnitude, below that rounded to fp16's subnormal step of 2^-24):
  the input rounded once to fp16, 11 significant bits. PARTS = 1.
- bf16 weights: rounding the input to bf16 (8 bits, ~2^-9 relative error per projection) would
  drift the talker's logits below the engine issue's cosine 0.9999 against the fp32 model. Instead
  the input is written as PARTS = 2 bf16 halves, hi = bf16(x) and lo = bf16(x - hi), stacked as
  twice the rows, and the halves summed by whatever reads the result: x to ~16 significant bits,
  for twice the rows (free while a GEMM is bound by reading its weights, not in a prefill).
- fp32 weights: the input itself and an fp32 GEMM. PARTS = 1.

`split` writes the parts (with the residual add of the previous projection's parts and the RMSNorm
before this one folded in); `project` multiplies (one fp16 row, a talker step at one row in
flight: by `gemv`, which reads the weights faster than cuBLAS at that size); the attention and
SwiGLU kernels read and write parts with `load_parts` / `store_parts`; `linear` is the round trip
for a lone projection.
"""
import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tts_kernels.launch import let_dependents_launch, programmatic, wait_for_predecessor


def parts_of(dtype: torch.dtype) -> int:
    """How many parts a GEMM input of this dtype (its weights') is written as (module doc)."""
    return 2 if dtype == torch.bfloat16 else 1


@triton.jit
def load_parts(ptr, offsets, part_stride, mask, PARTS: tl.constexpr):
    """The fp32 sum of the parts at ptr + offsets (part p is part_stride elements further), added
    in part order."""
    value = tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    for part in tl.static_range(1, PARTS):
        value += tl.load(ptr + part * part_stride + offsets, mask=mask, other=0.0).to(tl.float32)
    return value


@triton.jit
def store_parts(ptr, offsets, part_stride, value, mask, PARTS: tl.constexpr):
    """fp32 value as PARTS parts: itself in ptr's dtype, or bf16 hi and the bf16 of what hi misses."""
    if PARTS == 2:
        hi = value.to(tl.bfloat16, fp_downcast_rounding="rtne")
        tl.store(ptr + offsets, hi, mask=mask)
        lo = (value - hi.to(tl.float32)).to(tl.bfloat16, fp_downcast_rounding="rtne")
        tl.store(ptr + part_stride + offsets, lo, mask=mask)
    else:
        tl.store(ptr + offsets, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split(x_ptr, x_rows_ptr, delta_ptr, norm_ptr, out_ptr, residual_ptr, rows, width, eps,
           GATHER: tl.constexpr, ADD: tl.constexpr, DELTA_PARTS: tl.constexpr, NORM: tl.constexpr,
           PARTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < width
    offsets = row * width + cols
    let_dependents_launch(PDL)
    if NORM:
        weight = tl.load(norm_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    wait_for_predecessor(PDL)
    if GATHER:
        x = tl.load(x_ptr + tl.load(x_rows_ptr + row) * width + cols, mask=valid, other=0.0)
    else:
        x = tl.load(x_ptr + offsets, mask=valid, other=0.0)
    if ADD:
        x += load_parts(delta_ptr, offsets, rows * width, valid, DELTA_PARTS)
        tl.store(residual_ptr + offsets, x, mask=valid)
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
        x = weight * (x * rstd)
    store_parts(out_ptr, offsets, rows * width, x, valid, PARTS)


def split(x: torch.Tensor, dtype: torch.dtype, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
          delta: torch.Tensor | None = None, residual: torch.Tensor | None = None,
          x_rows: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, D] fp32 -> RMSNorm(x) (with norm_weight) or x as the input of a GEMM over `dtype`
    weights: [parts_of(dtype) * M, D] of that dtype (fp32: the values themselves). delta
    [delta_parts * M, D] fp32, a projection's output: first added to x (the residual add), the sum
    written to `residual` (default: x itself, in place). x_rows [M] (int64): row r is x[x_rows[r]],
    read from x as a table (an embedding lookup without a kernel of its own)."""
    rows, width = x.shape if x_rows is None else (x_rows.shape[0], x.shape[1])
    if x_rows is not None and delta is not None and residual is None:
        raise ValueError("split: a gathered x has no rows of its own to add delta into; give `residual`")
    parts = parts_of(dtype)
    out = torch.empty(parts * rows, width, device=x.device, dtype=dtype)
    _split[(rows,)](x, x_rows.contiguous() if x_rows is not None else x, delta if delta is not None else x,
                    norm_weight if norm_weight is not None else x, out,
                    residual if residual is not None else x, rows, width, eps, GATHER=x_rows is not None,
                    ADD=delta is not None,
                    DELTA_PARTS=1 if delta is None else delta.shape[0] // rows, NORM=norm_weight is not None,
                    PARTS=parts, BLOCK=triton.next_power_of_2(width), **programmatic(x))
    return out


@triton.jit
def _gemv_weights(w_ptr, n, valid, cols, K, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(w_ptr + n[:, None] * K + cols[None, :])
    return tl.load(w_ptr + n[:, None] * K + cols[None, :], mask=valid[:, None] & (cols < K)[None, :], other=0.0)


@triton.jit
def _gemv_input(x_ptr, cols, K, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(x_ptr + cols).to(tl.float32)
    return tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)


@triton.jit
def gemv_sums(x_ptr, w_ptr, n, valid, K, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr):
    """sum over k of w[n, k] * x[k] for the weight rows n (those `valid`; all when EVEN): the 16-bit
    products exact in fp32, summed in fp32 per lane of BLOCK_K, the lanes added at the end (a fixed
    order). The first chunk of weights is read before waiting for the kernel that wrote x
    (tts_kernels.launch)."""
    lanes = tl.arange(0, BLOCK_K)
    let_dependents_launch(PDL)
    w = _gemv_weights(w_ptr, n, valid, lanes, K, EVEN)
    wait_for_predecessor(PDL)
    acc = w.to(tl.float32) * _gemv_input(x_ptr, lanes, K, EVEN)[None, :]
    for k in range(BLOCK_K, K, BLOCK_K):
        acc += _gemv_weights(w_ptr, n, valid, k + lanes, K, EVEN).to(tl.float32) * \
            _gemv_input(x_ptr, k + lanes, K, EVEN)[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _gemv(x_ptr, w_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
          PDL: tl.constexpr):
    """out[n] = sum over k of w[n, k] * x[k], for BLOCK_N rows of w (gemv_sums)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + n, gemv_sums(x_ptr, w_ptr, n, n < N, K, BLOCK_K, EVEN, PDL), mask=n < N)


# gemv's tiles: rows of the weight per program, lanes (the K chunk), warps. One tile for all was
# chosen end to end, with the kernels launched as programmatic dependents (tts_kernels.launch), by
# `tts bench --concurrency 1` on the H200 (audio-s/s): 4 x 1024 x 4 23.4-23.6, 2 x 1024 x 4 23.6,
# 4 x 2048 x 4 23.7, 8 x 2048 x 8 22.8, 8 x 512 x 8 20.8-21.0 (docs/bench.md at 0bca9b7, 2026-12-01).
# Per stage in that sweep the talker was fastest at 2 x 1024 x 4 (1.141 against 1.163 ms per step)
# and the code predictor's loop at 4 x 2048 x 4 (1.886 against 1.926): gemv_tile gives each its own.
GEMV_TILE_WIDE, GEMV_TILE_NARROW = (2, 1024, 4), (4, 2048, 4)


def gemv_tile(n: int, k: int) -> tuple[int, int, int]:
    """The tile of a one-row projection over a weight [n, k]: at 1.7B the talker's are at least 2048
    on both sides (hidden 2048), the code predictor's 1024 on one (hidden 1024)."""
    return GEMV_TILE_WIDE if min(n, k) >= 2048 else GEMV_TILE_NARROW


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1, K] @ weight [N, K].T -> [1, N] fp32, both 16-bit and contiguous. H200, one row over 28
    distinct weights in a CUDA graph, us per call, cuBLAS (torch.mm to fp32) against this kernel's
    best tiles of a sweep: 4096 x 2048 7.35 / 6.08, 2048 x 2048 6.22 / 4.31, 12288 x 2048 15.2 /
    14.6, 2048 x 6144 10.8 / 9.6 (docs/bench.md at 0bca9b7, 2026-11-30). The tile: gemv_tile."""
    n, k = weight.shape
    block_n, lanes, warps = gemv_tile(n, k)
    block_k = min(lanes, triton.next_power_of_2(k))
    out = torch.empty(1, n, device=x.device, dtype=torch.float32)
    _gemv[(triton.cdiv(n, block_n),)](x, weight, out, n, k, BLOCK_N=block_n, BLOCK_K=block_k,
                                      EVEN=n % block_n == 0 and k % block_k == 0, num_warps=warps, num_stages=3,
                                      **programmatic(x))
    return out


def takes_gemv(x_parts: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `project` runs this input through the GEMV kernel: one fp16 row on the GPU (not
    inside cublas_projections)."""
    return _few_row_kernels and x_parts.device.type != "cpu" and x_parts.shape[0] == 1 \
        and x_parts.dtype == torch.float16 and x_parts.is_contiguous() and weight.is_contiguous()


@triton.jit
def _rows_dot(x, w, acc, SWAP: tl.constexpr):
    """acc + x @ w.T, as x @ w.T or (SWAP) as (w @ x.T).T: the weight rows on the tensor-core
    product's M side, which Hopper's wgmma wants at least 64 of, and the few x rows on its N side."""
    if SWAP:
        acc = tl.dot(w, tl.trans(x), acc)
    else:
        acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def gemm_rows_sums(x_ptr, w_ptr, w_rows, M, K: tl.constexpr, k_start, k_part: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr, PDL: tl.constexpr):
    """[BLOCK_M, len(w_rows)] fp32: sum over k in [k_start, k_start + k_part) of x[m, k] *
    w[w_rows[j], k] for every row m < M (the rest 0), on the tensor cores, fp32 accumulation in
    BLOCK_K steps (a fixed order). The first weight chunk is read before waiting for the kernel
    that wrote x (tts_kernels.launch), as in _gemv. One piece for gemm_rows and gemm_rows_silu.
    SWAP: the products as w @ x.T (_rows_dot), the sums transposed at the end."""
    m = tl.arange(0, BLOCK_M)
    ks = k_start + tl.arange(0, BLOCK_K)
    rows = m[:, None] < M
    if SWAP:
        acc = tl.zeros((w_rows.shape[0], BLOCK_M), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, w_rows.shape[0]), tl.float32)
    # Under 64 rows the dependents launch only once the sums are done, which measured faster (H200,
    # docs/bench.md at 0bca9b7, 2026-12-01: talker ms per step 1.678 -> 1.453 at 32 rows); at 64 rows
    # it lost (1.508 -> 1.523). Why is not known: early dependents' CTAs and their first weight reads
    # may compete with this kernel's.
    if BLOCK_M >= 64:
        let_dependents_launch(PDL)
    w = tl.load(w_ptr + w_rows[:, None] * K + ks[None, :])
    wait_for_predecessor(PDL)
    x = tl.load(x_ptr + m[:, None] * K + ks[None, :], mask=rows, other=0.0)
    acc = _rows_dot(x, w, acc, SWAP)
    for k in range(BLOCK_K, k_part, BLOCK_K):
        w = tl.load(w_ptr + w_rows[:, None] * K + (k + ks)[None, :])
        x = tl.load(x_ptr + m[:, None] * K + (k + ks)[None, :], mask=rows, other=0.0)
        acc = _rows_dot(x, w, acc, SWAP)
    if BLOCK_M < 64:
        let_dependents_launch(PDL)
    return tl.trans(acc) if SWAP else acc


@triton.jit
def _gemm_rows(x_ptr, w_ptr, out_ptr, M, N: tl.constexpr, K: tl.constexpr, SLICES: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
               PDL: tl.constexpr):
    """out[s * M + m, n] = sum over k in slice s of x[m, k] * w[n, k], for every row m, BLOCK_N rows
    of w and K slice s = program_id(1) (of SLICES)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    part = tl.program_id(1)
    k_part: tl.constexpr = K // SLICES
    acc = gemm_rows_sums(x_ptr, w_ptr, n, M, K, part * k_part, k_part, BLOCK_M, BLOCK_K, SWAP, PDL)
    m = tl.arange(0, BLOCK_M)
    tl.store(out_ptr + (part * M + m[:, None]) * N + n[None, :], acc, mask=m[:, None] < M)


# gemm_rows: the fewest and the most rows `project` gives it (else cuBLAS), its K chunk, and the
# programs it aims for (one per SM of the H200, about). H200, talker ms per step against cuBLAS
# (docs/bench.md at 0bca9b7, 2026-12-01), before partial sums were swapped: 8 rows
# 1.764 / 1.640, 32 rows 2.124 / 1.749, 64 rows 1.759 / 1.869. Swapped, with the dependents
# launched after the sums: 8 rows 1.368 / 1.579, 32 rows 1.453 / 1.678 (2026-12-01).
GEMM_ROWS_MIN, GEMM_ROWS_MAX, GEMM_ROWS_BLOCK_K, GEMM_ROWS_PROGRAMS = 2, 64, 128, 128


_few_row_kernels = True   # cublas_projections


@contextlib.contextmanager
def cublas_projections():
    """Inside it, `project` and `project_silu` run cuBLAS at every row count, never the GEMV or
    gemm_rows: for a tail step of GEMM_ROWS_MAX rows or fewer, whose rows must get the sums of the
    full step of more rows, which runs cuBLAS (tts_cli.engine.TAIL_MIN_ROWS). Read when a call is
    traced, so it holds in the CUDA graphs captured inside it."""
    global _few_row_kernels
    before, _few_row_kernels = _few_row_kernels, False
    try:
        yield
    finally:
        _few_row_kernels = before


def gemm_rows_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `project` runs this projection on gemm_rows: GEMM_ROWS_MIN to GEMM_ROWS_MAX fp16 rows
    over fp16 weights on CUDA, N a multiple of 16 and K of its chunk (not inside cublas_projections)."""
    n, k = weight.shape
    return _few_row_kernels and x.is_cuda and x.dtype == weight.dtype == torch.float16 \
        and GEMM_ROWS_MIN <= x.shape[0] <= GEMM_ROWS_MAX and n % 16 == 0 and k % GEMM_ROWS_BLOCK_K == 0 \
        and x.is_contiguous() and weight.is_contiguous()


@dataclass(frozen=True)
class RowsTile:
    """How one gemm_rows launch cuts its work: weight rows per program, K slices (partial sums that
    the reader adds), the K chunk of one tensor-core step, warps, pipeline stages, and whether the
    product is taken as w @ x.T (`swap`: under 64 rows Triton 3.6 compiles x @ w.T to mma.sync, at
    64 to wgmma; w @ x.T is wgmma from 64 weight rows per program at any row count;
    tools/sm90_compile.py shows which)."""
    block_n: int
    slices: int = 1
    block_k: int = GEMM_ROWS_BLOCK_K
    warps: int = 4
    stages: int = 4
    swap: bool = False


def rows_tile(n: int, k: int, partial_sums: bool = False) -> RowsTile:
    """The tile of a weight [n, k]. Every program reads all of x, so wide blocks of weight rows:
    where the caller takes partial sums, 64 rows per program over as many K slices as keep
    ~GEMM_ROWS_PROGRAMS programs, swapped (wgmma under 64 rows; at 64 the same code). H200, the
    talker's projections in gemm_bench's chain (docs/bench.md at 0bca9b7, 2026-12-01): q/k/v 8.0 us on
    two slices against 9.1 on whole 32-row blocks at 64 rows; at 32 rows q/k/v 7.2, o 4.7 and down
    10.0 us swapped, against 7.7, 6.8 and 12.6 on cuBLAS. Else 64 or 32 rows, whichever still gives
    GEMM_ROWS_PROGRAMS programs, else 16."""
    if partial_sums and n % 64 == 0:
        slices = 1
        while n // 64 * slices * 2 <= GEMM_ROWS_PROGRAMS and k % (2 * slices * GEMM_ROWS_BLOCK_K) == 0:
            slices *= 2
        return RowsTile(64, slices, swap=True)
    block_n = next((b for b in (64, 32) if n % b == 0 and n // b >= GEMM_ROWS_PROGRAMS), None)
    return RowsTile(block_n or 16)


def gemm_rows_launch(x: torch.Tensor, tile: RowsTile) -> dict:
    """The launch settings of a gemm_rows kernel: the row tile, the K chunk, warps, stages, PDL."""
    return dict(BLOCK_M=max(16, triton.next_power_of_2(x.shape[0])), BLOCK_K=tile.block_k, SWAP=tile.swap,
                num_warps=tile.warps, num_stages=tile.stages, **programmatic(x))


def gemm_rows(x: torch.Tensor, weight: torch.Tensor, partial_sums: bool = False,
              tile: RowsTile | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T -> [M, N] fp32 for a few rows (a decode step's, up to
    GEMM_ROWS_MAX): each program reads its rows of the weight once, for all M rows, and is launched
    as a programmatic dependent, its first weight chunk read before it waits (cuBLAS kernels are
    not). With partial_sums the caller takes [S * M, N] instead, S >= 1 partial sums over K slices
    (a parts tensor: tts_kernels.linear's readers add them in order). tile: rows_tile's unless
    given (tools/gemm_bench.py sweeps them)."""
    (rows, k), n = x.shape, weight.shape[0]
    tile = tile or rows_tile(n, k, partial_sums)
    if n % tile.block_n or k % (tile.slices * tile.block_k) or (tile.slices > 1 and not partial_sums):
        raise ValueError(f"{tile} does not cut a [{n}, {k}] weight" + ("" if partial_sums else " into whole sums"))
    out = torch.empty(tile.slices * rows, n, device=x.device, dtype=torch.float32)
    _gemm_rows[(n // tile.block_n, tile.slices)](x, weight, out, rows, n, k, tile.slices, BLOCK_N=tile.block_n,
                                                 **gemm_rows_launch(x, tile))
    return out


def project(x_parts: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
            partial_sums: bool = False) -> torch.Tensor:
    """x_parts [P * M, K] (split's output) times weight.T: [P * M, N] fp32; the bias joins part 0.
    partial_sums: the caller also takes [S * M, N], S >= 1 sums to add (gemm_rows)."""
    if x_parts.device.type == "cpu":   # (Triton's interpreter) CPU torch has no 16-bit mm to fp32: widen, same sums
        out = x_parts.float() @ weight.float().t()
    elif takes_gemv(x_parts, weight):
        out = gemv(x_parts, weight)
    elif gemm_rows_fits(x_parts, weight):
        out = gemm_rows(x_parts, weight, partial_sums)
    elif x_parts.dtype == torch.float32:
        out = torch.mm(x_parts, weight.t())   # (torch.mm: a tail step's PaddedGEMMs pads it)
    else:
        out = torch.mm(x_parts, weight.t(), out_dtype=torch.float32)
    if bias is not None:
        out[:x_parts.shape[0] // parts_of(x_parts.dtype)] += bias   # part 0's rows
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 @ weight.T (+ bias) -> fp32 [..., N]."""
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()
    out = project(split(rows, weight.dtype), weight, bias)
    if parts_of(weight.dtype) == 2:
        out = out[:rows.shape[0]] + out[rows.shape[0]:]
    return out.view(*x.shape[:-1], weight.shape[0])
