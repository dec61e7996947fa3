"""tts_kernels.preload on CPU. Triton's compiler needs no GPU, so each process here compiles the
RMSNorm kernel for the H200 (sm_90) as the GPU machine does, through a stand-in for Triton's CUDA
driver that answers what compiling and loading a kernel ask of it; each process is a subprocess,
the stand-in set before anything launches. tests/test_gpu.py runs the same on the GPU with the
engine."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tts_kernels import preload

ROOT = Path(__file__).resolve().parents[1]
KERNEL = "tts_kernels.rms_norm._rms_norm_rows"

PROCESS = """
import json
import logging
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import MockTensor


class Utils:
    def load_binary(self, name, kernel, shared, device):   # module, function, registers, spills, threads
        return None, None, 0, 0, 1024

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132}


class H200WithoutGpu:
    utils = Utils()

    @staticmethod
    def launcher_cls(src, metadata):
        return None

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


logging.basicConfig(level=logging.INFO, stream=sys.stderr)
driver.set_active(H200WithoutGpu())
torch.cuda.set_device = lambda index: None   # preload.load makes its device current
from tts_kernels import preload
from tts_kernels.rms_norm import _rms_norm_rows


def launch(width):
    # warmup: what a launch does up to the launch itself (the kernel found in its cache or compiled)
    f32 = MockTensor(torch.float32)
    return _rms_norm_rows.warmup(f32, f32, f32, width, 1e-6, BLOCK=triton.next_power_of_2(width), grid=(1,))


if sys.argv[1] == "record":
    preload.record_at_exit()
    launch(96)
    launch(2048)
    # a kernel whose options its metadata misreports (as Triton's do for warp-specialized kernels):
    # its record would not find its binary, so it gets none
    rewritten = launch(200)
    rewritten.metadata = rewritten.metadata._replace(num_warps=8)
else:
    cache_hits = []
    triton.knobs.compilation.listener = lambda **seen: cache_hits.append(seen["cache_hit"])
    preload.start(torch.device("cuda"))
    loaded = preload.finish()
    by_preload = list(cache_hits)
    launch(96)
    preload.record()
    print(json.dumps({"loaded": loaded, "preload_cache_hits": by_preload,
                      "compiles_at_launch": len(cache_hits) - len(by_preload),
                      "at_launch": preload.loaded_at_launch()}))
"""

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _process(mode: str, cache: Path, switch: str = "1") -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), TTS_KERNEL_PRELOAD=switch,
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "kernels"), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-c", PROCESS, mode], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def _load(cache: Path, switch: str = "1") -> tuple[dict, str]:
    run = _process("load", cache, switch)
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def _record_file(cache: Path) -> Path:
    [path] = cache.glob("tts-kernels-*.json")
    return path


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """A Triton cache after a process that launched the kernel at widths 96, 2048 and 200 (the last
    with rewritten metadata) and exited."""
    cache = tmp_path_factory.mktemp("triton") / "cache"
    _process("record", cache)
    return cache


@pytest.fixture
def cache(recorded, tmp_path) -> Path:
    return Path(shutil.copytree(recorded, tmp_path / "cache"))


@needs_triton
def test_recorded_kernels_load_in_a_new_process_and_their_first_launch_finds_them(cache):
    records = [json.loads(r) for r in json.loads(_record_file(cache).read_text())["records"]]
    assert [r["name"] for r in records] == [KERNEL, KERNEL]
    assert sorted(r["constant_vals"] for r in records) == [[128], [2048]]   # BLOCK; not 256 (rewritten)
    result, _ = _load(cache)
    # both read from Triton's disk cache, none compiled; the launch found its kernel in the cache
    assert result == {"loaded": 2, "preload_cache_hits": [True, True], "compiles_at_launch": 0, "at_launch": []}


@needs_triton
def test_a_corrupt_record_file_is_ignored_with_a_log_line(cache):
    path = _record_file(cache)
    path.write_text('{"records": [', encoding="utf-8")
    result, stderr = _load(cache)
    assert result["loaded"] == 0 and result["at_launch"] == [KERNEL]   # loaded at its launch instead
    assert f"kernel preload: {path} ignored (JSONDecodeError" in stderr
    # what that process launched, recorded over the corrupt file
    assert [json.loads(r)["name"] for r in json.loads(path.read_text())["records"]] == [KERNEL]


@needs_triton
def test_switched_off_it_records_and_loads_nothing(cache, tmp_path):
    fresh = tmp_path / "fresh"
    _process("record", fresh, switch="0")
    assert any(fresh.iterdir()) and not list(fresh.glob("tts-kernels-*"))   # Triton's binaries only
    before = _record_file(cache).read_text()
    result, _ = _load(cache, switch="0")
    assert result["loaded"] == 0 and result["at_launch"] == [KERNEL]
    assert _record_file(cache).read_text() == before


def test_the_record_file_follows_triton_the_gpu_and_the_kernel_sources(tmp_path):
    sources = tmp_path / "tts_kernels"
    sources.mkdir()
    for path in preload.SOURCES.glob("*.py"):
        shutil.copy(path, sources)
    first = preload.digest("3.6.0", "cuda:90:32", sources)
    assert preload.digest("3.6.0", "cuda:90:32", sources) == first
    assert preload.digest("3.7.0", "cuda:90:32", sources) != first
    assert preload.digest("3.6.0", "cuda:100:32", sources) != first
    kernel = sources / "rms_norm.py"
    kernel.write_text(kernel.read_text().replace("+ eps", "+ eps * 1.0"))
    assert preload.digest("3.6.0", "cuda:90:32", sources) != first
