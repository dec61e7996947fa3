"""Times a split-K Triton GEMM (bf16 parts x bf16 weights -> fp32 partial sums, summed later by the
reader, as tts_kernels.linear's hi/lo parts are) against cuBLAS (`torch.mm(..., out_dtype=float32)`)
at the projection shapes of the 1.7B model, GPU only. Microseconds per call from triton's
do_bench (L2 flushed between calls: a decode step reads its weights from memory).

    python tools/gemm_bench.py [--rows 2,128,512] [--sweep-rows 128]

Tiles are swept at --sweep-rows; other row counts run the best tiles found there.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

# (name, K, N): talker hidden 2048, code predictor 1024 (1.7B); gate/up merged
SHAPES = [("talker qkv", 2048, 4096), ("talker o", 2048, 2048), ("talker gate/up", 2048, 12288),
          ("talker down", 6144, 2048), ("talker head", 2048, 3072), ("cp qkv", 1024, 4096), ("cp o", 2048, 1024),
          ("cp gate/up", 1024, 6144), ("cp down", 3072, 1024), ("cp head", 1024, 2048)]


@triton.jit
def _gemm_split_k(a_ptr, w_ptr, out_ptr, M, N, K: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, K // SPLIT_K, BLOCK_K):
        ks = split * (K // SPLIT_K) + start + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * K + ks[None, :], mask=row_ok[:, None], other=0.0)
        w = tl.load(w_ptr + cols[None, :] * K + ks[:, None], mask=col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc)
    tl.store(out_ptr + split * M * N + rows[:, None] * N + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def call(a, w, out, split_k, block_m, block_n, block_k, warps, stages):
    m, k = a.shape
    n = w.shape[0]
    return lambda: _gemm_split_k[(triton.cdiv(n, block_n), triton.cdiv(m, block_m), split_k)](
        a, w, out, m, n, k, split_k, block_m, block_n, block_k, num_warps=warps, num_stages=stages)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="128,2,512", help="GEMM rows (hi and lo parts: twice the batch rows)")
    parser.add_argument("--sweep-rows", type=int, default=128)
    args = parser.parse_args()
    chosen = {}
    for rows in map(int, args.rows.split(",")):
        for name, k, n in SHAPES:
            a = torch.randn(rows, k, device="cuda").bfloat16()
            w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
            ref = torch.mm(a, w.t(), out_dtype=torch.float32)
            cublas = do_bench(lambda: torch.mm(a, w.t(), out_dtype=torch.float32))
            floor = w.numel() * 2 / 4.8e12 * 1e6
            results = []
            block_m = min(128, max(16, triton.next_power_of_2(rows)))
            configs = (itertools.product((1, 2, 4, 8), (32, 64, 128), (128,), (4,), (3,))
                       if rows == args.sweep_rows or name not in chosen else [chosen[name]])
            for split_k, block_n, block_k, warps, stages in configs:
                if k % (split_k * block_k):
                    continue
                out = torch.empty(split_k, rows, n, device="cuda")
                try:
                    fn = call(a, w, out, split_k, block_m, block_n, block_k, warps, stages)
                    fn()
                    err = ((out.sum(0) - ref).norm() / ref.norm()).item()
                    if err > 1e-5:
                        continue
                    results.append((do_bench(fn) * 1e3, (split_k, block_n, block_k, warps, stages)))
                except Exception:   # out of resources for this tile
                    continue
            results.sort()
            best = results[0] if results else (float("nan"), None)
            if rows == args.sweep_rows and results:
                chosen[name] = best[1]
            print(f"rows {rows:4d} {name:15s} floor {floor:5.1f} us  cuBLAS {cublas * 1e3:6.1f} us  "
                  f"split-K best {best[0]:6.1f} us (split, BN, BK, warps, stages = {best[1]}); "
                  f"next: {[(round(t, 1), c) for t, c in results[1:3]]}", flush=True)


if __name__ == "__main__":
    main()
