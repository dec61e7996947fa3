"""The engine's few-row projections (tts_kernels.linear.gemm_rows, and gemm_rows_silu for the
gate/up ones) against cuBLAS at the 1.7B projection shapes, over tiles: which RowsTile each shape
should take. GPU only.

    python tools/gemm_bench.py [--rows 8,32,64] [--shapes talker] [--sweep] [--json OUT.json]

Each arm is timed as a decode step runs it: a CUDA graph of one call per copy of the weight, the
copies together over 2x the L2 (so every call reads its weight from memory), the calls back to
back (gemm_rows launched as programmatic dependents, as in the engine); microseconds per call,
median of the replays. With --hot every call reads the same copy instead: from L2 where it fits
(all but gate/up, whose 50 MB fill it), the most that weights brought into L2 ahead of their
kernel could give. Every arm's result is checked against the fp64 product of the same fp16
values first (partial sums added), and refused above 1e-5 of the largest output. Arms: cuBLAS
(torch.mm to fp32, then silu_mul for gate/up), the engine's tile (rows_tile; silu_tile for
gate/up), and with --sweep other tiles: weight rows per program x K slices x K chunk x the
product's orientation (`swap`, from 64 weight rows), at 4 warps and 4 stages, then warps and
stages around the best of those. K slices for the heads too, whose reader (the sampler) takes
whole sums today: what partial sums there would buy (the best whole-sum tile is printed too). The
JSON keeps every tile timed, fastest first.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import torch

from step_profile import median_ms
from tts_cli.engine.graphs import capture
from tts_kernels.linear import RowsTile, gemm_rows, rows_tile
from tts_kernels.swiglu import gemm_rows_silu, silu_mul, silu_tile

# (name, N, K, kind): the 1.7B talker (hidden 2048) and code predictor (hidden 1024); gate/up
# merged. kind: "whole" sums (the heads: the sampler reads them), "partial" sums (q/k/v, o and down:
# attention and split add them), "silu" (gate/up).
SHAPES = [("talker qkv", 4096, 2048, "partial"), ("talker o", 2048, 2048, "partial"),
          ("talker gate/up", 12288, 2048, "silu"), ("talker down", 2048, 6144, "partial"),
          ("talker head", 3072, 2048, "whole"),
          ("cp qkv", 4096, 1024, "partial"), ("cp o", 1024, 2048, "partial"), ("cp gate/up", 6144, 1024, "silu"),
          ("cp down", 1024, 3072, "partial"), ("cp head", 2048, 1024, "whole")]
L2_BYTES = 50 * 2**20   # the H200's


def arm(kind: str, tile: RowsTile | None):
    """x, w -> the projection's fp32 output (partial sums added, gate/up as silu(gate) * up)."""
    if tile is None:   # cuBLAS
        mm = lambda x, w: torch.mm(x, w.t(), out_dtype=torch.float32)
        return (lambda x, w: silu_mul(mm(x, w), torch.float16)) if kind == "silu" else mm
    if kind == "silu":
        return lambda x, w: gemm_rows_silu(x, w, tile)
    return lambda x, w: gemm_rows(x, w, partial_sums=kind == "partial" or tile.slices > 1, tile=tile)


def summed(out: torch.Tensor, rows: int) -> torch.Tensor:
    return out.double().view(-1, rows, out.shape[-1]).sum(0)


def expected(x: torch.Tensor, w: torch.Tensor, kind: str) -> torch.Tensor:
    exact = x.double() @ w.double().t()
    if kind != "silu":
        return exact
    gate, up = exact.chunk(2, dim=1)
    return torch.nn.functional.silu(gate) * up


def time_us(project, x: torch.Tensor, weights: list[torch.Tensor], replays: int) -> float:
    """Median microseconds per call of project over every copy, back to back in one CUDA graph."""
    graph, _ = capture(lambda: [project(x, w) for w in weights])
    return median_ms(graph.replay, replays) * 1000 / len(weights)


def cuts(tile: RowsTile, n: int, k: int, kind: str) -> bool:
    """Whether the tile cuts a weight [n, k] whole (gate/up: in halves of gate and up rows)."""
    rows_per_program = tile.block_n // 2 if kind == "silu" else tile.block_n
    width = n // 2 if kind == "silu" else n
    return width % rows_per_program == 0 and k % (tile.slices * tile.block_k) == 0


def engine_tile(n: int, k: int, kind: str) -> RowsTile:
    return silu_tile(n, k) if kind == "silu" else rows_tile(n, k, kind == "partial")


def candidates(n: int, k: int, kind: str, sweep: bool) -> list[RowsTile]:
    """The engine's tile first, then (--sweep) the others that cut the shape."""
    engine = engine_tile(n, k, kind)
    if not sweep:
        return [engine]
    slices = (1,) if kind == "silu" else (1, 2, 4, 8)
    tiles = [RowsTile(block_n, s, block_k, swap=swap)
             for block_n, s, block_k, swap in itertools.product((16, 32, 64, 128), slices, (64, 128), (False, True))]
    # 64-512 programs: fewer leave most of the 132 SMs idle, more re-read x from L2 for little;
    # swapped, the weight rows are the product's M side, which wgmma takes 64 at a time
    return [engine] + [t for t in tiles if t != engine and cuts(t, n, k, kind)
                       and 64 <= (n // t.block_n) * t.slices <= 512 and (not t.swap or t.block_n >= 64)]


def bench_shape(name: str, n: int, k: int, kind: str, rows: int, sweep: bool, replays: int,
                hot: bool = False) -> dict:
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(rows, k, device="cuda", generator=g).half()
    copies = max(2, -(-2 * L2_BYTES // (n * k * 2)))
    distinct = 1 if hot else copies
    weights = [(torch.randn(n, k, device="cuda", generator=g) * 0.02).half()
               for _ in range(distinct)] * (copies // distinct)
    reference = expected(x, weights[0], kind)
    scale = reference.abs().max().item()
    floor_us = n * k * 2 / 4.8e12 * 1e6

    def run(tile: RowsTile | None) -> float | None:
        project = arm(kind, tile)
        try:
            out = project(x, weights[0])
        except Exception as error:   # out of registers or shared memory for this tile
            print(f"  {tile}: {type(error).__name__}: {str(error)[:100]}")
            return None
        got = out.double() if kind == "silu" else summed(out, rows)
        # fp16 outputs (gate/up) carry fp16 rounding on top of the sums' error
        if (got - reference).abs().max().item() > (1e-3 if kind == "silu" else 1e-5) * scale:
            print(f"  {tile}: wrong result, refused")
            return None
        return time_us(project, x, weights, replays)

    result = dict(name=name, n=n, k=k, kind=kind, rows=rows, hot=hot, floor_us=round(floor_us, 2), cublas_us=run(None))
    timed = [(us, tile) for tile in candidates(n, k, kind, sweep) if (us := run(tile)) is not None]
    engine = timed[0] if timed and timed[0][1] == engine_tile(n, k, kind) else (None, None)
    if sweep and timed:
        best = min(timed, key=lambda item: item[0])[1]
        for warps, stages in itertools.product((4, 8), (3, 4, 5)):
            tile = dataclasses.replace(best, warps=warps, stages=stages)
            if tile != best and (us := run(tile)) is not None:
                timed.append((us, tile))
    timed.sort(key=lambda item: item[0])
    result.update(engine_tile=vars(engine[1]) if engine[1] else None, engine_us=engine[0],
                  tiles=[dict(us=round(us, 2), **vars(tile)) for us, tile in timed])
    best_us = timed[0][0] if timed else float("nan")
    print(f"{name:15s} {rows} rows  floor {floor_us:6.1f} us  cuBLAS {result['cublas_us'] or float('nan'):6.1f}  "
          f"engine {engine[0] or float('nan'):6.1f} {engine[1]}  best {best_us:6.1f} {timed[0][1] if timed else None}",
          flush=True)
    # the heads' reader (the sampler) cannot take the K-sliced tiles yet
    whole = next(((us, tile) for us, tile in timed if tile.slices == 1), None)
    if kind == "whole" and whole and whole is not timed[0]:
        print(f"{'':15s} best in whole sums {whole[0]:6.1f} {whole[1]}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="64", help="comma-separated; the engine runs gemm_rows at 2-64")
    parser.add_argument("--shapes", default="", help="only shapes whose name contains this (e.g. talker, cp, gate/up)")
    parser.add_argument("--sweep", action="store_true", help="time other tiles too (each is a compile)")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--hot", action="store_true",
                        help="every call reads the same weight copy (from L2 where it fits)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = [bench_shape(name, n, k, kind, rows, args.sweep, args.replays, args.hot)
               for rows in map(int, args.rows.split(",")) for name, n, k, kind in SHAPES if args.shapes in name]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, results=results), f, indent=1)


if __name__ == "__main__":
    main()
