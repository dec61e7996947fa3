"""The codec's precision options on a GPU: SNR against the exact fp32 full decode, and time per
streamed call of the engine's shape (rows x K frames), random weights at the real 1.7B codec
shapes (tts_cli.engine.random_model). GPU only; prints one line per option.

    python tools/codec_bench.py [--rows 64] [--window 4]
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

from tts_cli.engine.random_model import build_random


def snr_db(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (got.float() - ref).pow(2).sum()))


def streamed(codec, codes: torch.Tensor, window: int) -> torch.Tensor:
    state = codec.new_state(codes.shape[0])
    return torch.cat([codec.decode_step(codes[:, t:t + window], state).float()
                      for t in range(0, codes.shape[1], window)], dim=1)


def per_call_ms(codec, rows: int, window: int, calls: int = 20) -> float:
    state = codec.new_state(rows)
    codes = torch.randint(0, 2048, (rows, window, 16), device="cuda")
    for _ in range(3):
        codec.decode_step(codes, state)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        codec.decode_step(codes, state)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--window", type=int, default=4)
    args = parser.parse_args()
    _, codec32 = build_random("1.7b", "cuda", torch.bfloat16)
    codes = torch.randint(0, 2048, (4, 96, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    with torch.no_grad():
        ref = codec32.decode(codes)
    options = {}
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        codec = copy.deepcopy(codec32).to(dtype)
        codec.quantizer.tables = codec32.quantizer.tables.to(dtype)
        options[name] = (codec, False)
    options["fp32"] = (codec32, False)
    options["fp32 + TF32"] = (codec32, True)
    for benchmark in (False, True):
        torch.backends.cudnn.benchmark = benchmark
        for name, (codec, tf32) in options.items():
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
            with torch.no_grad():
                quality = snr_db(streamed(codec, codes, args.window), ref)
                ms = per_call_ms(codec, args.rows, args.window)
            print(f"cudnn.benchmark {benchmark!s:5}  {name:12s} SNR {quality:5.1f} dB   {ms:6.2f} ms per call of "
                  f"{args.rows} rows x {args.window} frames ({ms / args.window:5.2f} ms per step)", flush=True)


if __name__ == "__main__":
    main()
