"""Can the codec run alongside the decode steps? A codec window (K = 4 steps) at `rows` rows as
the engine runs it (random weights at the real 1.7B shapes, its stage graphs), timed four ways:

  serial:   4 x (depth, talker), then the codec, on one stream (what the engine does)
  streams:  4 x (depth, talker) on a high-priority stream, the codec on a low-priority one
  green N:  the same two streams in CUDA green contexts: the codec on N SMs, the steps on the rest

The steps are a chain of ~1200 small kernels bound by latency, the codec a few hundred large
ones bound by compute: on shared SMs the codec's blocks hold the SMs the chain's next kernel
waits for, so only a partition may let both run at their own pace. GPU only; prints a line per way.

Green contexts are off by default: the persistent depth kernel (`--depth auto` from 2 rows over
fp16 weights) launches one CTA per SM of the whole GPU and its CTAs wait for each other, so on
fewer SMs than that it would never finish. They are for the loop (`--depth loop`), or for the
kernel on fewer CTAs (`--depth-ctas`: the same ways again with a kernel of that many CTAs, whose
green contexts leave it at least that many SMs).

    python tools/overlap_bench.py [--rows 64] [--depth auto|kernel|loop] [--green 32,48,64,80] [--replays 20]
    python tools/overlap_bench.py --rows 64 --depth-ctas 100,84 --green 32,48
"""
from __future__ import annotations

import argparse

import torch

from step_profile import filled_engine, median_ms
from tts_cli.bench import load_synthesizer
from tts_cli.engine import DEFAULT_DEPTH, DEPTH_CHOICES
from tts_cli.synthesizer import weights_dtype
from tts_kernels.depth_frame import DepthFrame

STEPS = 4


def captured(fn, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()   # warm up on this stream (and context)
    stream.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph


def on_streams(*work):
    """A launch of (stream, graph) pairs, each graph on its stream, forked from and joined to
    the current stream."""
    def launch():
        main = torch.cuda.current_stream()
        for stream, graph in work:
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                graph.replay()
        for stream, _ in work:
            main.wait_stream(stream)
    return launch


def time_ways(fns, replays: int, green: list[int], depth_ctas: int | None) -> None:
    """Print the serial, two-stream and green-context times of a window's steps and its codec."""
    def steps():
        for _ in range(STEPS):
            fns["depth"]()
            fns["talker"]()

    main_stream = torch.cuda.Stream()
    serial = captured(lambda: (steps(), fns["codec"]()), main_stream)
    steps_alone, codec_alone = captured(steps, main_stream), captured(fns["codec"], main_stream)
    print(f"serial: {median_ms(serial.replay, replays) / STEPS:.3f} ms per step "
          f"(steps alone {median_ms(steps_alone.replay, replays) / STEPS:.3f}, "
          f"codec alone {median_ms(codec_alone.replay, replays) / STEPS:.3f})", flush=True)
    high, low = torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=0)
    launch = on_streams((low, captured(fns["codec"], low)), (high, captured(steps, high)))
    print(f"streams: {median_ms(launch, replays) / STEPS:.3f} ms per step", flush=True)
    total = torch.cuda.get_device_properties(0).multi_processor_count
    for codec_sms in green:
        if depth_ctas is not None and depth_ctas > total - codec_sms:
            print(f"green {codec_sms}: skipped (the depth kernel's {depth_ctas} CTAs need that many SMs)")
            continue
        try:
            from torch.cuda.green_contexts import GreenContext
            codec_ctx = GreenContext.create(num_sms=codec_sms, device_id=0)
            steps_ctx = GreenContext.create(num_sms=total - codec_sms, device_id=0)
            codec_stream, steps_stream = codec_ctx.Stream(), steps_ctx.Stream()
            codec = (codec_stream, captured(fns["codec"], codec_stream))
            chain = (steps_stream, captured(steps, steps_stream))
            print(f"green {codec_sms}: {median_ms(on_streams(codec, chain), replays) / STEPS:.3f} ms per step "
                  f"(steps alone on {total - codec_sms} SMs {median_ms(on_streams(chain), replays) / STEPS:.3f}, "
                  f"codec alone on {codec_sms} {median_ms(on_streams(codec), replays) / STEPS:.3f})", flush=True)
        except Exception as error:   # a probe: report and go on
            print(f"green {codec_sms}: {type(error).__name__}: {error}", flush=True)
            import torch.cuda.green_contexts as green_contexts
            print("  torch.cuda.green_contexts:", [n for n in dir(green_contexts.GreenContext) if not n.startswith("__")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--depth", default=DEFAULT_DEPTH, choices=DEPTH_CHOICES)
    parser.add_argument("--green", default="", help="SM counts for the codec's green context (with --depth loop, "
                        "or with --depth-ctas at most the SMs left: module doc)")
    parser.add_argument("--depth-ctas", default="", help="then again with the persistent depth kernel on this many "
                        "CTAs (comma-separated), leaving SMs to the codec")
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    synth = load_synthesizer("random:1.7b", "cuda", weights_dtype("cuda"))
    engine = filled_engine(synth, args.rows, args.depth)
    green = [int(n) for n in args.green.split(",") if n]
    with torch.no_grad():
        time_ways(engine.step.stage_fns, args.replays, green if engine.step.depth_frame is None else [], None)
        for ctas in (int(n) for n in args.depth_ctas.split(",") if n):
            if engine.step.depth_frame is None:
                raise SystemExit("--depth-ctas needs the persistent depth kernel (--depth auto or kernel)")
            # the stage function reads the frame at each call, so the graphs captured next use this one
            engine.step.depth_frame = DepthFrame(synth.model.code_predictor, args.rows, ctas=ctas)
            print(f"-- the depth kernel on {ctas} CTAs", flush=True)
            time_ways(engine.step.stage_fns, args.replays, green, ctas)


if __name__ == "__main__":
    main()
