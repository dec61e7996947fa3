"""Where the wall time of a whole engine run goes: the GPU's busy time by what the host was doing
when it queued the work (admission and prefill, decode steps, the early window close, draining),
and the GPU's idle gaps by what the host was doing when the work that ended each gap was queued.

`tts bench` reports `prefill` and `host` per step from CUDA events; this shows what is inside
them. It also reports what the GPU runs at once (its time by the set of kinds of work running
together: the depth kernel, the rest of the decode steps, the codec, the admissions), and where the
host's time inside each admission goes (outermost torch ops and CUDA runtime calls). It runs
`--requests` forced-length requests (as `tts bench --frames auto`) at `--rows` rows under torch's
profiler, on random weights at the real shapes. GPU only. The profiler slows the
host a little: compare its wall time with `tts bench`'s before reading small gaps.

    python tools/run_profile.py [--size 1.7b] [--rows 64] [--requests 400] [--top 15] [--json FILE]
"""
from __future__ import annotations

import argparse
import bisect
import collections
import json
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from tts_cli.bench import load_synthesizer, make_requests, read_sentences, warm_engine
from tts_cli.engine import DEFAULT_TALKER_PRECISION, TALKER_PRECISIONS
from tts_cli.engine.runner import Engine
from tts_cli.synthesizer import weights_dtype

# the runner's methods whose host time is named in the report
RANGES = {"_admit": "admit + prefill", "_launch_step": "decode step", "_launch_codec": "codec window",
          "_drain": "drain"}
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def annotate(engine: Engine) -> None:
    """Wraps the runner's methods named in RANGES in profiler ranges (on this instance only)."""
    for method, label in RANGES.items():
        inner = getattr(engine, method)

        def wrapped(*args, _inner=inner, _label=label, **kwargs):
            with record_function(_label):
                return _inner(*args, **kwargs)
        setattr(engine, method, wrapped)


def gpu_work(trace: dict) -> list[tuple[dict, float | None, str]]:
    """The trace's GPU work in start order, each as (event, when the host queued it or None, the
    host range it was queued in: a RANGES name or "other host work")."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ranges = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                    if e.get("cat") == "user_annotation" and e["name"] in RANGES.values())
    starts = [r[0] for r in ranges]

    def host_range(ts) -> str:
        i = bisect.bisect_right(starts, ts) - 1 if ts is not None else -1
        return ranges[i][2] if i >= 0 and ranges[i][1] >= ts else "other host work"

    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    queued = [launches.get(e.get("args", {}).get("correlation")) for e in gpu]
    return [(e, ts, host_range(ts)) for e, ts in zip(gpu, queued)]


def analyse(trace: dict, top: int) -> dict:
    busy_by = collections.Counter()
    kernels_by = collections.defaultdict(collections.Counter)
    counts_by = collections.defaultdict(collections.Counter)
    idle_by, gaps_by = collections.Counter(), collections.Counter()
    end = previous = first = None
    busy = idle = 0.0
    for e, launched, where in gpu_work(trace):
        correlation = e.get("args", {}).get("correlation")
        first = e["ts"] if first is None else first
        busy_by[where] += e["dur"]
        kernels_by[where][e["name"][:100]] += e["dur"]
        counts_by[where][e["name"][:100]] += 1
        if end is not None and e["ts"] > end:
            gap = e["ts"] - end
            if launched is None or launched > end:
                cause = where
            elif correlation == previous:
                cause = "between kernels of one graph"
            else:   # queued before the GPU went idle: it waited on something else (an event, a launch)
                cause = "queued earlier"
            idle_by[cause] += gap
            gaps_by[cause] += 1
            idle += gap
        busy += e["dur"] if end is None else max(0.0, e["ts"] + e["dur"] - max(end, e["ts"]))
        end = e["ts"] + e["dur"] if end is None else max(end, e["ts"] + e["dur"])
        previous = correlation
    span = (end - first) if first is not None else 0.0
    return {
        "gpu_span_ms": span / 1e3, "gpu_busy_ms": busy / 1e3, "gpu_idle_ms": idle / 1e3,
        "busy_ms_by_host_range": {k: v / 1e3 for k, v in busy_by.most_common()},
        "idle_ms_by_host_range": {k: v / 1e3 for k, v in idle_by.most_common()},
        "idle_gaps_by_host_range": dict(gaps_by.most_common()),
        "top_kernels_by_host_range": {
            where: [(name, us / 1e3, counts_by[where][name]) for name, us in kernels.most_common(top)]
            for where, kernels in kernels_by.items()},
    }


def _kind(event: dict, where: str) -> str:
    if where == "decode step":
        return "depth kernel" if event["name"].startswith("_depth_frame") else "decode step, rest"
    return where


def concurrency(trace: dict) -> dict:
    """GPU time (ms) by the set of kinds of work running at that moment, each kind being the host
    range that queued the work (the depth kernel apart from the rest of the decode steps). Two
    kinds together: work of both had started and not ended (on streams of their own), which says
    nothing of how the SMs were shared meanwhile."""
    edges = []   # (time, +1 / -1, kind)
    for e, _, where in gpu_work(trace):
        kind = _kind(e, where)
        edges += [(e["ts"], 1, kind), (e["ts"] + e["dur"], -1, kind)]
    edges.sort(key=lambda edge: (edge[0], edge[1]))
    running, together, last = collections.Counter(), collections.Counter(), None
    for ts, step, kind in edges:
        if last is not None and ts > last and +running:
            together[" + ".join(sorted(+running))] += ts - last
        running[kind] += step
        last = ts
    return {k: v / 1e3 for k, v in together.most_common()}


def host_calls(trace: dict, range_name: str, top: int) -> dict:
    """Per occurrence of a host range (averaged): its time, the time inside its outermost torch ops,
    and its outermost torch ops and CUDA runtime calls by time, in ms (calls per occurrence)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events
             if e.get("cat") == "user_annotation" and e["name"] == range_name]
    calls = sorted((e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver")),
                   key=lambda e: e["ts"])
    call_starts = [c["ts"] for c in calls]
    times, counts = collections.Counter(), collections.Counter()
    for start, end in spans:
        outer_end = None
        for e in calls[bisect.bisect_left(call_starts, start):]:
            if e["ts"] > end:
                break
            if e["cat"] == "cpu_op":
                if outer_end is not None and e["ts"] < outer_end:
                    continue   # inside an outer op: counted there
                outer_end = e["ts"] + e["dur"]
            key = f"{e['cat']}: {e['name'][:80]}"
            times[key] += e["dur"]
            counts[key] += 1
    n = max(len(spans), 1)
    return {"occurrences": len(spans), "ms_each": sum(b - a for a, b in spans) / 1e3 / n,
            "ms_each_in_outer_torch_ops": sum(v for k, v in times.items() if k.startswith("cpu_op")) / 1e3 / n,
            "calls": [(k, v / 1e3 / n, counts[k] / n) for k, v in times.most_common(top)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1.7b")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--talker-precision", default=DEFAULT_TALKER_PRECISION, choices=TALKER_PRECISIONS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    synth = load_synthesizer(f"random:{args.size}", "cuda", weights_dtype("cuda", args.talker_precision))
    requests = make_requests(synth, read_sentences(), args.requests, None, "vivian")
    engine = warm_engine(synth, args.rows, requests)
    with torch.no_grad():
        start = time.perf_counter()
        engine.run(requests)
        torch.cuda.synchronize()
        plain_wall = time.perf_counter() - start
        engine.reset_stats()
        annotate(engine)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            results = engine.run(requests)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
        report = analyse(trace, args.top)
        report["gpu_ms_by_work_running_together"] = concurrency(trace)
        report["admission_host"] = host_calls(trace, RANGES["_admit"], args.top)
    frames = sum(len(r.codes) for r in results)
    report = {"rows": args.rows, "requests": args.requests, "frames": frames, "steps": engine.stats.steps,
              "wall_ms_unprofiled": plain_wall * 1e3, "wall_ms_profiled": wall * 1e3, **report}
    steps = max(engine.stats.steps, 1)
    print(f"{args.rows} rows, {args.requests} requests, {frames} frames in {steps} steps; wall {plain_wall * 1e3:.1f} ms "
          f"unprofiled, {wall * 1e3:.1f} profiled; GPU busy {report['gpu_busy_ms']:.1f} ms, idle "
          f"{report['gpu_idle_ms']:.1f} ms ({1e3 * report['gpu_idle_ms'] / steps:.0f} us per step)")
    for title, key in (("GPU busy, ms, by the host range that queued it", "busy_ms_by_host_range"),
                       ("GPU idle, ms, by the host range that queued the work ending the gap", "idle_ms_by_host_range")):
        print(title)
        for where, ms in report[key].items():
            gaps = report["idle_gaps_by_host_range"].get(where)
            print(f"  {ms:9.2f}  {where}" + (f" ({gaps} gaps)" if key.startswith("idle") else ""))
    for where, kernels in report["top_kernels_by_host_range"].items():
        print(f"kernels queued by {where}:")
        for name, ms, count in kernels:
            print(f"  {ms:8.2f} ms  {count:6d} x  {name}")
    print("GPU time, ms, by the work running at once (kinds: the host range that queued it)")
    for kinds, ms in report["gpu_ms_by_work_running_together"].items():
        print(f"  {ms:9.2f}  {kinds}")
    admission = report["admission_host"]
    print(f"host time of an admission ({admission['occurrences']}): {admission['ms_each']:.3f} ms, "
          f"{admission['ms_each_in_outer_torch_ops']:.3f} of it in its outermost torch ops; by call (ms, calls):")
    for name, ms, count in admission["calls"]:
        print(f"  {ms:8.3f} ms  {count:7.1f} x  {name}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
