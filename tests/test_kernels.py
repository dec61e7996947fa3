"""The Triton kernels against the torch code they replace. On CPU they run in Triton's
interpreter (TRITON_INTERPRET=1, set before triton is imported: hence a subprocess), in fp32:
the interpreter's fp32 -> bf16 casts truncate instead of rounding, so bf16 is checked on the
GPU (tests/test_gpu.py)."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

RMS_NORM_CHECK = """
import torch
from tts_cli.model.transformer import RMSNorm
from tts_kernels.rms_norm import rms_norm

g = torch.Generator().manual_seed(0)
for dtype, shape in ((torch.float32, (3, 5, 96)), (torch.float32, (7, 2048)), (torch.float32, (4, 2, 16, 128))):
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    norm = RMSNorm(shape[-1], 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(shape[-1], generator=g))
    norm = norm.to(dtype)
    expected = norm(x)
    got = rms_norm(x, norm.weight, norm.eps)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
print("rms_norm ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_rms_norm_kernel_equals_torch_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "kernels"), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", RMS_NORM_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rms_norm ok" in run.stdout


def test_kernels_are_not_used_off_cuda():
    import tts_kernels
    ok, why = tts_kernels.available("cpu")
    assert not ok and "CUDA" in why
