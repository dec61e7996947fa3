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
