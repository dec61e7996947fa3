"""Would the engine gain from running its rows as groups side by side? The code predictor's loop
(as the engine runs it: random weights at the real 1.7B shapes, bf16, fused kernels) for `rows`
rows as one chain of kernels, against G chains of rows / G on G streams in one CUDA graph.

At 64 rows each of the loop's ~850 kernels fills a fraction of the 132 SMs and mostly waits on
memory latency (bench.md: a 64-row frame costs what a 1-row frame costs), so independent chains
may overlap. Each group keeps fixed shapes, so a seeded row would still not depend on its batch
mates. GPU only; prints one line per group count.

    python tools/row_groups_bench.py [--rows 64] [--groups 1,2,4] [--replays 100]
"""
from __future__ import annotations

import argparse

import torch

from depth_bench import median_replay_us, setup
from tts_cli.engine.graphs import capture
from tts_cli.engine.random_model import build_random
from tts_cli.model.transformer import use_kernels
from tts_kernels.sampler import sample_rows


def depth_chain(cp, talker, rows: int, seed: int):
    """One frame of the code predictor's loop for `rows` rows, as a callable."""
    hidden, code0_embed, sampling, seeds, frame, caches = setup(cp, talker, rows, seed)

    def draw(group, logits):
        return sample_rows(logits, sampling.temperature, sampling.top_k, sampling.do_sample, seeds, frame, group)
    return lambda: cp.predict_frame(hidden, code0_embed, draw, caches=caches)


def side_by_side(chains):
    """One callable running each chain on its own stream, forked from and joined back to the
    current stream (so that it can be captured as one graph)."""
    streams = [torch.cuda.Stream() for _ in chains]

    def run():
        main = torch.cuda.current_stream()
        for stream, chain in zip(streams, chains):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                chain()
        for stream in streams:
            main.wait_stream(stream)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--groups", default="1,2,4")
    parser.add_argument("--replays", type=int, default=100)
    args = parser.parse_args()
    model, _ = build_random("1.7b", "cuda", torch.bfloat16)
    use_kernels(model, True)
    cp, talker = model.code_predictor, model.talker
    graphs = {}
    with torch.no_grad():
        for groups in (int(g) for g in args.groups.split(",")):
            if args.rows % groups:
                raise SystemExit(f"--rows {args.rows} is not a multiple of {groups} groups")
            run = side_by_side([depth_chain(cp, talker, args.rows // groups, seed=g) for g in range(groups)])
            for _ in range(3):
                run()
            torch.cuda.synchronize()
            graphs[groups] = capture(run)[0]
    for groups, us in median_replay_us(graphs, args.replays).items():
        print(f"depth frame, {args.rows} rows as {groups} group(s) of {args.rows // groups}: "
              f"{us:8.1f} us (median of {args.replays}, arms alternated)", flush=True)


if __name__ == "__main__":
    main()
