"""The engine's attention kernels timed alone: by default the talker's in a decode step
(tts_kernels.attention.cached_attention: one new token per row against its static KV cache) at the
1.7B shapes (16 query heads, 8 key/value heads of 128), against what reading its keys and values
from memory costs. GPU only.

    python tools/attention_bench.py [--rows 1,64] [--positions 20-110] [--context 256] [--qkv-parts 2]
                                    [--variants "block_k=64;block_k=128,num_warps=8;decode=0"]
    python tools/attention_bench.py --codec-window [--rows 1,64] [--frames 4] [--positions 20-110]

The code predictor's shape: `--positions 2-15 --context 16` (its frame's 16 positions); from 64
rows cached_attention runs its one-token kernel there (`decode=0` forces the general one, `decode=1`
the one-token one). `--qkv-parts 1` as cuBLAS writes the q/k/v projection above 64 rows.

`--codec-window`: the codec transformer's window attention instead (tts_kernels.window_attention:
16 heads of 64, window 72, fp32 ring caches), `--frames` new frames per row and call (the
engine's codec window: 4, 16 at one row), each row at a position drawn from --positions, 8 layers
graphed; variants are its `one_warp=0|1`; the floor is the ring's bytes at 4.8 TB/s.

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
from tts_kernels.window_attention import window_attention

Q_HEADS, KV_HEADS, HEAD_DIM, LAYERS = 16, 8, 128, 28
CODEC_HEADS, CODEC_HEAD_DIM, CODEC_WINDOW, CODEC_LAYERS = 16, 64, 72, 8
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


def window_inputs(rows: int, frames: int, low: int, high: int, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = CODEC_HEADS * CODEC_HEAD_DIM
    angles = torch.rand(rows, frames, 1, device="cuda", generator=g) * torch.arange(CODEC_HEAD_DIM, device="cuda")
    return dict(qkv=[torch.randn(rows, frames, 3 * width, device="cuda", generator=g) for _ in range(CODEC_LAYERS)],
                cache=[torch.randn(rows, 2, CODEC_HEADS, CODEC_WINDOW - 1, CODEC_HEAD_DIM, device="cuda", generator=g)
                       for _ in range(CODEC_LAYERS)],
                cos=angles.cos(), sin=angles.sin(),
                start=torch.randint(low, high + 1, (rows,), device="cuda", generator=g))


def window_call(x: dict, layer: int, cache: torch.Tensor | None = None, **variant) -> torch.Tensor:
    q, k, v = x["qkv"][layer].split(CODEC_HEADS * CODEC_HEAD_DIM, dim=-1)
    return window_attention(q, k, v, x["cos"], x["sin"], x["cache"][layer] if cache is None else cache, x["start"],
                            CODEC_WINDOW, **{k: bool(v) for k, v in variant.items()})


def time_us(call, x: dict, layers: int, replays: int, **variant) -> float:
    graph, _ = capture(lambda: [call(x, layer, **variant) for layer in range(layers)])
    return median_ms(graph.replay, replays) * 1000 / layers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--positions", default="20-110", help="LOW-HIGH: where each row's new token goes")
    ap.add_argument("--context", type=int, default=256, help="the caches' capacity (positions)")
    ap.add_argument("--qkv-parts", type=int, default=2,
                    help="parts of the q/k/v projection's output: 2 partial sums from gemm_rows (2-64 rows), "
                    "1 from cuBLAS")
    ap.add_argument("--variants", help="';'-separated settings after the default: cached_attention's "
                    "'block_k=N,num_warps=W,decode=0|1' (default: four block_k and warps pairs), window_attention's "
                    "'one_warp=0|1' (default: both)")
    ap.add_argument("--codec-window", action="store_true", help="the codec's window attention (module doc)")
    ap.add_argument("--frames", type=int, default=4, help="with --codec-window: new frames per row and call")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    low, high = (int(p) for p in args.positions.split("-"))
    if args.variants is None:
        args.variants = "one_warp=0;one_warp=1" if args.codec_window else \
            "block_k=64;block_k=128;block_k=64,num_warps=8;block_k=128,num_warps=8"
    variants = [""] + [v for v in args.variants.split(";") if v]
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        if args.codec_window:
            x, run, layers = window_inputs(rows, args.frames, low, high), window_call, CODEC_LAYERS
            floor_us = x["cache"][0].numel() * 4 / PEAK_BYTES_PER_US   # the fp32 ring's keys and values
            first = lambda **variant: window_call(x, 0, x["cache"][0].clone(), **variant)   # the ring kept as it is
        else:
            x, run, layers = inputs(rows, low, high, args.context, args.qkv_parts), call, LAYERS
            keys = int((x["start"] + 1).sum())
            floor_us = keys * KV_HEADS * HEAD_DIM * 2 * 2 / PEAK_BYTES_PER_US   # keys and values, fp16
            first = lambda **variant: call(x, 0, **variant)
        with torch.no_grad():
            reference = first().float()
            for text in variants:
                variant = parse_settings(text)
                error = (first(**variant).float() - reference).abs().max().item() / reference.abs().max().item()
                us = time_us(run, x, layers, args.replays, **variant)
                results.append(dict(rows=rows, variant=text or "default", us=round(us, 2), floor_us=round(floor_us, 2),
                                    error_of_max=error))
                print(json.dumps(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), positions=args.positions, context=args.context,
                           results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
