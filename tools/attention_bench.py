"""The talker's attention in a decode step (tts_kernels.attention.cached_attention: one new token
per row against its static KV cache) at the 1.7B shapes (16 query heads, 8 key/value heads of
128), timed alone, against what reading its keys and values from memory costs. GPU only.

    python tools/attention_bench.py [--rows 1,64] [--positions 20-110] [--context 256] [--qkv-parts 2]
                                    [--variants "block_k=64;block_k=128,num_warps=8;decode=0"]

The code predictor's shape: `--positions 2-15 --context 16` (its frame's 16 positions); from 64
rows cached_attention runs its one-token kernel there (`decode=0` forces the general one, `decode=1`
the one-token one). `--qkv-parts 1` as cuBLAS writes the q/k/v projection above 64 rows.

Each row's new token goes to a position drawn uniformly from --positions (the forced lengths of
`tts bench` put a talker row at ~20-110), so a call reads that many keys and values per row and
head. A CUDA graph runs the call once per layer (28, each with caches of its own, together
larger than the L2, so every call reads from memory), back to back as in a step (programmatic
dependents, as the engine launches them); microseconds per call, median of the replays. The
floor is the call's cache bytes at 4.8 TB/s. Every variant's output is checked against the
default's first (the order of the softmax's steps differs, so not bit for bit: the largest
difference over the largest output is printed).
"""
from __future__ import annotations

import argparse
import json

import torch

from step_profile import median_ms, parse_settings
from tts_cli.engine.graphs import capture
from tts_kernels.attention import cached_attention

Q_HEADS, KV_HEADS, HEAD_DIM, LAYERS = 16, 8, 128, 28
PEAK_BYTES_PER_US = 4.8e6   # the H200's memory, 4.8 TB/s


def inputs(rows: int, low: int, high: int, context: int, qkv_parts: int, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    cache = lambda: torch.randn(rows, KV_HEADS, context, HEAD_DIM, device="cuda", generator=g).half()
    angles = torch.arange(context, device="cuda")[:, None] * torch.rand(HEAD_DIM, device="cuda", generator=g)
    return dict(qkv=[torch.randn(qkv_parts * rows, width, device="cuda", generator=g) for _ in range(LAYERS)],
                k=[cache() for _ in range(LAYERS)], v=[cache() for _ in range(LAYERS)],
                q_norm=torch.rand(HEAD_DIM, device="cuda", generator=g) + 0.5,
                k_norm=torch.rand(HEAD_DIM, device="cuda", generator=g) + 0.5,
                cos=angles.cos(), sin=angles.sin(), rows=torch.arange(rows, device="cuda"),
                start=torch.randint(low, high + 1, (rows,), device="cuda", generator=g))


def call(x: dict, layer: int, **variant) -> torch.Tensor:
    return cached_attention(x["qkv"][layer], Q_HEADS, KV_HEADS, HEAD_DIM, x["q_norm"], x["k_norm"], 1e-6, x["cos"],
                            x["sin"], x["k"][layer], x["v"][layer], x["rows"], x["start"], 1, HEAD_DIM ** -0.5,
                            torch.float16, **variant)


def time_us(x: dict, replays: int, **variant) -> float:
    graph, _ = capture(lambda: [call(x, layer, **variant) for layer in range(LAYERS)])
    return median_ms(graph.replay, replays) * 1000 / LAYERS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--positions", default="20-110", help="LOW-HIGH: where each row's new token goes")
    ap.add_argument("--context", type=int, default=256, help="the caches' capacity (positions)")
    ap.add_argument("--qkv-parts", type=int, default=2,
                    help="parts of the q/k/v projection's output: 2 partial sums from gemm_rows (2-64 rows), 1 from cuBLAS")
    ap.add_argument("--variants", default="block_k=64;block_k=128;block_k=64,num_warps=8;block_k=128,num_warps=8",
                    help="';'-separated 'block_k=N,num_warps=W' settings of cached_attention, after its default")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    low, high = (int(p) for p in args.positions.split("-"))
    variants = [""] + [v for v in args.variants.split(";") if v]
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        x = inputs(rows, low, high, args.context, args.qkv_parts)
        keys = int((x["start"] + 1).sum())
        floor_us = keys * KV_HEADS * HEAD_DIM * 2 * 2 / PEAK_BYTES_PER_US   # keys and values, fp16
        with torch.no_grad():
            reference = call(x, 0).float()
            for text in variants:
                variant = parse_settings(text)
                error = (call(x, 0, **variant).float() - reference).abs().max().item() / reference.abs().max().item()
                results.append(dict(rows=rows, variant=text or "default", us=round(time_us(x, args.replays, **variant), 2),
                                    floor_us=round(floor_us, 2), error_of_max=error))
                print(json.dumps(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), positions=args.positions, context=args.context,
                           results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
