"""Where a decode step's GPU time goes, kernel by kernel: the engine's stage graphs (depth, codec,
talker) at `rows` rows on random weights at the real shapes, each replayed under torch's profiler;
then the prefill: its largest packed tile's graph (rows x 4 tokens, at most 2048) and one whole
admission of rows / 8 prompts (its tiles plus the eager work around them: packing, logits, first
draw, slot state).

Per stage it prints the replay's wall time (CUDA events, median), the summed time of its kernels
and their count (the difference is time the GPU spends between kernels), and the kernels that
take the most time. GPU only.

    python tools/step_profile.py [--size 1.7b] [--rows 64] [--replays 20] [--top 12] [--no-pdl]
"""
from __future__ import annotations

import argparse
import collections
import statistics

import torch
import tts_kernels.launch
from torch.profiler import ProfilerActivity, profile

from tts_cli.bench import load_synthesizer, make_requests, read_sentences
from tts_cli.engine import DEFAULT_DEPTH, DEFAULT_TALKER_PRECISION, TALKER_PRECISIONS
from tts_cli.engine.runner import Engine
from tts_cli.synthesizer import code_predictor_settings, talker_settings, weights_dtype


def parse_settings(text: str) -> dict[str, int]:
    """'name=N,name=N' (a tool's --variants item or --tiles) as {name: N}; empty items skipped."""
    return {k: int(v) for k, v in (item.split("=") for item in text.split(",") if item)}


def median_ms(launch, replays: int) -> float:
    """Median milliseconds of the work launch() queues (on the current stream, or on others it
    joins back to it)."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def filled_engine(synth, rows: int, depth: str = DEFAULT_DEPTH) -> Engine:
    """An engine of `rows` slots (its stage graphs captured) that has run one request per slot,
    8 frames each, so that its state holds real values."""
    sampling = synth.ckpt.sampling
    engine = Engine(synth.model, synth.codec, rows=rows, context=256, depth=depth, tail_rows=(),   # full step only
                    talker_defaults=talker_settings(sampling), cp_defaults=code_predictor_settings(sampling))
    with torch.no_grad():
        engine.run(make_requests(synth, read_sentences(), rows, 8, "vivian"))
    torch.cuda.synchronize()
    return engine


def kernel_times(launch, replays: int) -> dict[str, tuple[float, int]]:
    """name -> (microseconds per call, launches per call), over `replays` profiled calls of launch()."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            launch()
        torch.cuda.synchronize()
    totals: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and not event.name.startswith("Memcpy"):
            totals[event.name][0] += event.time_range.elapsed_us()
            totals[event.name][1] += 1
    return {name: (us / replays, count / replays) for name, (us, count) in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1.7b")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--talker-precision", default=DEFAULT_TALKER_PRECISION, choices=TALKER_PRECISIONS)
    parser.add_argument("--no-pdl", action="store_true",
                        help="launch without programmatic dependent launch, so that each kernel's time is its own "
                             "(with it, a kernel starts before its predecessor ends and its time includes the wait)")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    tts_kernels.launch.enabled = not args.no_pdl
    synth = load_synthesizer(f"random:{args.size}", "cuda", weights_dtype("cuda", args.talker_precision))
    engine = filled_engine(synth, args.rows)
    requests = make_requests(synth, read_sentences(), engine.prefill.head_rows, 8, "vivian")
    admission = list(enumerate(requests))   # into slots 0, 1, ... (idle after filled_engine's run)
    launches = {f"{name} stage": graph.replay for name, graph in engine.step.graphs.items()}
    if engine.prefill.graphs:
        size, (graph, _, _) = max(engine.prefill.graphs.items())   # the largest tile
        launches[f"prefill tile ({size} tokens)"] = graph.replay
    launches[f"admission of {len(admission)} prompts (tile and eager work)"] = lambda: engine._prefill(admission)
    with torch.no_grad():
        for name, launch in launches.items():
            launch()
            wall = median_ms(launch, args.replays)
            kernels = kernel_times(launch, args.replays)
            busy = sum(us for us, _ in kernels.values()) / 1e3
            count = sum(n for _, n in kernels.values())
            print(f"{name}: {wall:.3f} ms per call, kernels {busy:.3f} ms busy in {count:.0f} launches "
                  f"({1e3 * (wall - busy) / max(count, 1):.2f} us between kernels on average)")
            for kernel, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:args.top]:
                print(f"  {us:9.1f} us  {n:5.0f} x {us / n:7.2f} us  {kernel[:110]}")


if __name__ == "__main__":
    main()
