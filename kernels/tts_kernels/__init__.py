"""GPU kernels of the fast path (Triton). Each has a plain torch fallback in tts_cli that is the
reference it is tested against; `available()` says whether the kernels can run here, and why not.
"""
import importlib.util


def available(device_type: str) -> tuple[bool, str]:
    """(True, "") when the Triton kernels can run on this device type, else (False, the reason)."""
    if device_type != "cuda":
        return False, f"Triton kernels run on CUDA devices, not {device_type}"
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    return True, ""
