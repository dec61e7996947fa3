"""The persistent depth kernel (tts_kernels.depth_frame) against the code predictor's loop (the
engine's fused path) on random weights with the real 1.7B (or --size 0.6b) code predictor shapes, fp16 (or
--talker-precision bf16) weights as the engine holds them, on one GPU:
numerics with given codes, draws, determinism, and the frame time of each as a CUDA graph.

    python tools/depth_bench.py [--rows 1,16,32,64] [--size 1.7b|0.6b] [--talker-precision fp16|bf16] [--json OUT.json]
    timeout 120 python tools/depth_bench.py --rows 32,64 --groups 2   # two kernels of 16 / 32 rows sharing the SMs

Per rows: the largest logit difference over the largest logit (given codes: the loop's own
sampled codes), the share of greedy codes (argmax) the two sets of logits agree on, whether the kernel's
in-kernel draws equal the sampler kernel's draws from the kernel's logits, whether two kernel
runs are bit-identical, the median frame time of each arm (graph replays, arms alternated), and
where a timed kernel run (per-task timestamps) spends the frame, per task kind.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton

from step_profile import parse_settings
from tts_cli.engine import DEFAULT_TALKER_PRECISION, TALKER_PRECISIONS
from tts_cli.engine.depth_check import kernel_against_loop
from tts_cli.engine.graphs import capture
from tts_cli.engine.random_model import build_random
from tts_cli.model.sampler import RowSampling, SamplerSettings
from tts_cli.model.transformer import StaticKV, use_kernels
from tts_cli.synthesizer import weights_dtype
from tts_kernels.depth_frame import DepthFrame, attention_rows
from tts_kernels.sampler import sample_rows

GROUPS = 15


def setup(cp, talker, rows: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cfg = cp.decoder.cfg
    code0 = torch.randint(0, cp.heads[0].weight.shape[0], (rows,), device="cuda", generator=g)
    code0_embed = talker.codec_track(code0).float()
    # the talker's hidden state has the width of its embeddings (the 0.6B code predictor has no
    # input projection to read it from)
    hidden = torch.randn(rows, code0_embed.shape[1], device="cuda", generator=g)
    sampling = RowSampling.stack([SamplerSettings(do_sample=True, temperature=0.9, top_k=50, top_p=1.0)] * rows,
                                 "cuda")
    seeds = torch.randint(0, 2**62, (rows,), device="cuda", generator=g)
    frame = torch.full((rows,), 7, device="cuda")
    dtype = cp.decoder.layers[0].mlp.down_proj.weight.dtype   # the engine's caches are in the weights' dtype
    caches = [StaticKV(rows, cfg.num_kv_heads, 16, cfg.head_dim, "cuda", dtype) for _ in cp.decoder.layers]
    return hidden, code0_embed, sampling, seeds, frame, caches


def median_replay_us(graphs: dict, replays: int) -> dict:
    """Median microseconds per replay of each CUDA graph, the graphs' replays alternated."""
    times = {name: [] for name in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(replays):
        for name, graph in graphs.items():
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1000)
    return {name: statistics.median(samples) for name, samples in times.items()}


def compare(cp, talker, rows: int, replays: int = 0, tiles: dict | None = None, breakdown: bool = True,
            **launch) -> dict:
    """The kernel against the loop at `rows` rows (module doc); frame times when replays > 0, and
    then with `breakdown` a timed run's per-kind split. tiles, launch (num_warps, num_stages, ctas):
    the kernel's (DepthFrame)."""
    hidden, code0_embed, sampling, seeds, frame, caches = setup(cp, talker, rows, seed=rows)
    draw = lambda group, logits: sample_rows(logits, sampling.temperature, sampling.top_k, sampling.do_sample,
                                              seeds, frame, group)
    with torch.no_grad():
        x_in = cp.input_projection(torch.stack((hidden, code0_embed)))
        loop_codes, _ = cp.predict_frame(hidden, code0_embed, draw, caches=caches)
    kernel = DepthFrame(cp, rows, tiles=tiles, **launch)
    given = kernel_against_loop(cp, hidden, code0_embed, loop_codes, kernel)
    run = lambda **kw: kernel.run(x_in, sampling.temperature, sampling.top_k, sampling.do_sample, seeds, frame, **kw)
    sampled = run(store_logits=True).clone()
    own = torch.stack([draw(g + 1, kernel.logits[:rows, g]) for g in range(GROUPS)], dim=1)
    first_logits = kernel.logits[:rows].clone()
    again = run(store_logits=True)
    result = dict(rows=rows, logit_error_of_max=given["logit_error_of_max"], greedy_agreement=given["greedy_agreement"],
                  kernel_draws_equal_sampler=bool(torch.equal(sampled, own)),
                  two_runs_identical=torch.equal(sampled, again) and torch.equal(first_logits, kernel.logits[:rows]))
    if replays:
        # each arm as a CUDA graph, replays alternated
        with torch.no_grad():
            graphs = {"loop": capture(lambda: cp.predict_frame(hidden, code0_embed, draw, caches=caches))[0],
                      "kernel": capture(lambda: run())[0]}
        times = median_replay_us(graphs, replays)
        result.update(loop_us=times["loop"], kernel_us=times["kernel"])
        result["speedup"] = result["loop_us"] / result["kernel_us"]
    if replays and breakdown:
        timed = DepthFrame(cp, rows, timed=True, tiles=tiles, **launch)
        for _ in range(3):
            timed.run(x_in, sampling.temperature, sampling.top_k, sampling.do_sample, seeds, frame)
        torch.cuda.synchronize()
        result["timed_breakdown_us"] = {kind: {k: round(v, 2) for k, v in entry.items()}
                                        for kind, entry in timed.breakdown().items()}
    return result


def concurrent_groups(cp, talker, rows: int, groups: int, replays: int) -> dict:
    """`groups` persistent kernels of rows / groups rows each, each on its own stream, sharing the SMs
    and one copy of the weights: does a second resident CTA per SM hide the first's phase hand-offs
    and chains of dependent loads? Each group runs a tile of its own rows at 4 warps, which fits two
    CTAs per SM (compiled offline: 16 rows 255 registers and 60 KB, 32 rows 255 and 72 KB, at 4
    stages). Every CTA of a kernel must be resident (they wait on each other): where two do not fit
    the run never ends, so run it under `timeout`. Reports one group alone, the groups together and
    the engine's one kernel over all the rows (alternated), whether each group's codes together equal
    its codes alone, and group 0's logits against the loop's (given codes)."""
    each = rows // groups
    tile = max(16, triton.next_power_of_2(each))
    own_tile = dict(rows=tile, attn_rows=attention_rows(tile, cp.decoder.cfg.num_kv_heads))
    inputs = [setup(cp, talker, each, seed=each * 100 + g) for g in range(groups)]
    frames = [DepthFrame(cp, each, tiles=own_tile, num_warps=4) for _ in range(groups)]
    for frame in frames[1:]:
        frame.weights = frames[0].weights   # one copy, as one kernel over all rows would read
    whole = setup(cp, talker, rows, seed=rows)

    def runner(frame, group_inputs):
        hidden, code0_embed, sampling, seeds, position, _ = group_inputs
        x_in = cp.input_projection(torch.stack((hidden, code0_embed)))
        return lambda: frame.run(x_in, sampling.temperature, sampling.top_k, sampling.do_sample, seeds, position)

    with torch.no_grad():
        runs = [runner(frame, group_inputs) for frame, group_inputs in zip(frames, inputs)]
        one_kernel = runner(DepthFrame(cp, rows), whole)
        one_kernel()
        alone = [run().clone() for run in runs]
        hidden, code0_embed = inputs[0][:2]
        given = kernel_against_loop(cp, hidden, code0_embed, alone[0], frames[0])
        streams = [torch.cuda.Stream() for _ in runs]

        def together():
            main_stream = torch.cuda.current_stream()
            for stream, run in zip(streams, runs):
                stream.wait_stream(main_stream)
                with torch.cuda.stream(stream):
                    run()
            for stream in streams:
                main_stream.wait_stream(stream)

        together()
        torch.cuda.synchronize()
        same = all(torch.equal(frame.codes[:each], codes) for frame, codes in zip(frames, alone))
        graphs = {"one_alone": capture(runs[0])[0], "together": capture(together)[0],
                  "one_kernel": capture(one_kernel)[0]}
    times = median_replay_us(graphs, replays)
    return dict(rows=rows, groups=groups, rows_per_group=each, group_tile=own_tile, codes_equal_alone=same, **given,
                one_group_alone_us=times["one_alone"], groups_together_us=times["together"],
                one_kernel_all_rows_us=times["one_kernel"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,32,64")
    ap.add_argument("--size", default="1.7b", choices=("1.7b", "0.6b"), help="the 0.6B code predictor has no input projection")
    ap.add_argument("--talker-precision", default=DEFAULT_TALKER_PRECISION, choices=TALKER_PRECISIONS,
                    help="the weights' dtype, as `tts bench --talker-precision`")
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the timed runs (each is another compile)")
    ap.add_argument("--groups", type=int, default=0,
                    help="instead: this many kernels of rows / groups rows each at every --rows, on their own "
                         "streams together, against one alone (concurrent_groups; run under `timeout`)")
    ap.add_argument("--variants", default="", help="more kernel settings to time at the last --rows, ';'-separated, "
                    "each 'field=value,...' of depth_schedule.Shapes, num_warps, num_stages or ctas (fewer CTAs than "
                    "SMs), e.g. 'gate_up_block_k=256' or 'num_warps=4,num_stages=1' or 'ctas=100'")
    args = ap.parse_args(argv)
    model, _ = build_random(args.size, "cuda", weights_dtype("cuda", args.talker_precision))
    use_kernels(model, True)
    results = []
    for rows in [int(r) for r in args.rows.split(",")] if args.groups else []:
        results.append(concurrent_groups(model.code_predictor, model.talker, rows, args.groups, args.replays))
        print(json.dumps(results[-1]), flush=True)
    for rows in [int(r) for r in args.rows.split(",")] if not args.groups else []:
        results.append(compare(model.code_predictor, model.talker, rows, args.replays,
                               breakdown=not args.no_breakdown))
        print(json.dumps(results[-1]), flush=True)
    for variant in filter(None, args.variants.split(";")):
        settings = parse_settings(variant)
        launch = {k: settings.pop(k) for k in ("num_warps", "num_stages", "ctas") if k in settings}
        results.append(dict(variant=variant, **compare(model.code_predictor, model.talker, int(args.rows.split(",")[-1]),
                                                       args.replays, settings, not args.no_breakdown, **launch)))
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), size=args.size, talker_precision=args.talker_precision,
                           results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
