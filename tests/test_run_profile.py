"""tools/run_profile.py's trace analysis (the profiled run itself needs a GPU): GPU busy time goes to
the host range that queued it, and each idle gap to the cause named in its report."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from run_profile import analyse  # noqa: E402


def _event(cat, name, ts, dur, correlation=None):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
            "args": {} if correlation is None else {"correlation": correlation}}


def test_idle_gaps_are_charged_to_the_host_range_that_ended_them():
    trace = {"traceEvents": [
        _event("user_annotation", "admit + prefill", 0, 50),
        _event("cuda_runtime", "cudaLaunchKernel", 10, 2, 1),
        _event("cuda_runtime", "cudaGraphLaunch", 40, 5, 2),
        _event("user_annotation", "decode step", 60, 10),
        _event("cuda_runtime", "cudaGraphLaunch", 62, 5, 3),
        _event("user_annotation", "drain", 150, 20),
        _event("cuda_runtime", "cudaMemcpyAsync", 160, 2, 4),
        _event("kernel", "prefill_kernel", 20, 10, 1),        # gap 30 -> 45: launched at 40, in admit
        _event("kernel", "graph_a", 45, 20, 2),
        _event("kernel", "graph_b", 66, 10, 2),               # gap 65 -> 66: inside one graph
        _event("kernel", "step", 100, 30, 3),                 # gap 76 -> 100: launched at 62, before it
        _event("gpu_memcpy", "Memcpy HtoD", 165, 5, 4),       # gap 130 -> 165: launched at 160, in drain
    ]}
    report = analyse(trace, top=5)
    assert report["gpu_busy_ms"] == pytest.approx(0.075)
    assert report["gpu_idle_ms"] == pytest.approx(0.075)
    assert report["busy_ms_by_host_range"] == pytest.approx(
        {"admit + prefill": 0.040, "decode step": 0.030, "drain": 0.005})
    assert report["idle_ms_by_host_range"] == pytest.approx(
        {"admit + prefill": 0.015, "between kernels of one graph": 0.001, "queued earlier": 0.024, "drain": 0.035})
    assert report["idle_gaps_by_host_range"] == {"admit + prefill": 1, "between kernels of one graph": 1,
                                                 "queued earlier": 1, "drain": 1}
    assert report["top_kernels_by_host_range"]["admit + prefill"][0] == ("graph_a", 0.020, 1)


def test_gpu_time_is_split_by_the_work_running_together():
    """The depth kernel counts apart from the rest of a decode step; the codec's kernels, queued in
    its own range, overlap the step's for 10 us and the admission's for 5."""
    from run_profile import concurrency
    trace = {"traceEvents": [
        _event("user_annotation", "decode step", 0, 10),
        _event("cuda_runtime", "cudaGraphLaunch", 1, 1, 1),
        _event("user_annotation", "codec window", 20, 5),
        _event("cuda_runtime", "cudaGraphLaunch", 21, 1, 2),
        _event("user_annotation", "admit + prefill", 30, 10),
        _event("cuda_runtime", "cudaLaunchKernel", 31, 1, 3),
        _event("kernel", "_depth_frame", 10, 40, 1),
        _event("kernel", "_gemm_rows", 50, 20, 1),
        _event("kernel", "_conv", 60, 25, 2),
        _event("kernel", "prefill", 80, 30, 3),
    ]}
    assert concurrency(trace) == pytest.approx({
        "depth kernel": 0.040, "decode step, rest": 0.010, "codec window + decode step, rest": 0.010,
        "codec window": 0.010, "admit + prefill + codec window": 0.005, "admit + prefill": 0.025})


def test_an_admissions_host_time_is_split_by_its_outermost_calls():
    """Ops nested in an outer op count in the outer one only; runtime calls count on their own;
    the figures are per admission (two here)."""
    from run_profile import host_calls
    trace = {"traceEvents": [
        _event("user_annotation", "admit + prefill", 0, 100),
        _event("cpu_op", "aten::index_put_", 10, 40),
        _event("cpu_op", "aten::copy_", 20, 10),               # inside index_put_
        _event("cuda_runtime", "cudaLaunchKernel", 25, 4, 1),
        _event("cpu_op", "aten::pin_memory", 60, 20),
        _event("user_annotation", "admit + prefill", 200, 60),
        _event("cpu_op", "aten::index_put_", 210, 20),
        _event("cpu_op", "aten::mm", 300, 5),                  # after the range
    ]}
    report = host_calls(trace, "admit + prefill", top=5)
    assert report["occurrences"] == 2
    assert report["ms_each"] == pytest.approx(0.080)
    assert report["ms_each_in_outer_torch_ops"] == pytest.approx(0.040)
    assert report["calls"] == [("cpu_op: aten::index_put_", pytest.approx(0.030), 1.0),
                               ("cpu_op: aten::pin_memory", pytest.approx(0.010), 0.5),
                               ("cuda_runtime: cudaLaunchKernel", pytest.approx(0.002), 0.5)]
