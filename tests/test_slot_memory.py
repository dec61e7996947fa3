"""tools/slot_memory.py measures a CUDA device's memory: without one it says so and exits 2."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_slot_memory_without_cuda_says_so():
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "slot_memory.py"), "--model", str(ROOT), "--rows", "64"],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2, run.stderr
    assert "slot_memory.py measures a CUDA device's memory: none is available" in run.stderr
