"""The sampler kernel (tts_kernels.sampler.sample_rows) alone on the GPU, at the engine's shapes: the
code predictor's draws (2048 logits; one row at c1, where the loop draws 15 times per frame) and
the talker's codebook-0 draw (3072 logits with its processors), at each warp count asked for.
Prints microseconds per draw (a CUDA graph of 20 draws, median of 5 replays) and checks that every
warp count draws the same tokens.

    python3 tools/sampler_bench.py [--rows 1,8,64] [--warps 4,8,16]
"""
import argparse

import torch
import tts_kernels.sampler as sampler

from step_profile import median_ms
from tts_cli.engine.graphs import capture


def draws(rows: int, vocab: int, talker: bool):
    g = torch.Generator("cuda").manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, device="cuda", generator=g) * 3
    settings = dict(temperature=torch.full((rows, 1), 0.9, device="cuda"),
                    top_k=torch.full((rows,), 50, device="cuda", dtype=torch.int64),
                    do_sample=torch.ones(rows, dtype=torch.bool, device="cuda"),
                    seeds=torch.arange(rows, device="cuda", dtype=torch.int64), frame=7, group=0 if talker else 3)
    processing = None
    if talker:
        processing = sampler.TalkerProcessing(
            seen=torch.rand(rows, vocab, device="cuda", generator=g) < 0.02,
            repetition_penalty=torch.full((rows, 1), 1.05, device="cuda"),
            min_new_tokens=torch.full((rows,), 2, device="cuda", dtype=torch.int64),
            suppressed=torch.arange(vocab, device="cuda") >= vocab - 1024, eos=vocab - 1022)
    return lambda: sampler.sample_rows(logits, **settings, talker=processing)


def us_per_draw(call, repeats: int = 20) -> float:
    call()   # warm up (compile) before the capture
    torch.cuda.synchronize()
    graph, _ = capture(lambda: [call() for _ in range(repeats)])
    return median_ms(graph.replay, 5) * 1000 / repeats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--warps", default="4,8,16")
    args = parser.parse_args()
    chosen = sampler.sampler_warps
    for rows in [int(r) for r in args.rows.split(",")]:
        for vocab, talker, name in ((2048, False, "code predictor"), (3072, True, "talker")):
            call = draws(rows, vocab, talker)
            line, tokens = [], None
            for warps in [int(w) for w in args.warps.split(",")]:
                sampler.sampler_warps = lambda block, warps=warps: warps
                try:
                    drawn = call()
                    same = tokens is None or torch.equal(drawn, tokens)
                    tokens = drawn if tokens is None else tokens
                    line.append(f"{warps} warps {us_per_draw(call):6.2f} us{'' if same else ' DIFFERENT DRAWS'}")
                finally:
                    sampler.sampler_warps = chosen
            print(f"{name:14s} {rows:3d} rows x {vocab}: " + ", ".join(line), flush=True)


if __name__ == "__main__":
    main()
