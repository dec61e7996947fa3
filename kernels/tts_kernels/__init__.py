"""GPU kernels of the fast path (Triton). Each has a plain torch fallback in tts_cli that is the
reference it is tested against; `available()` says whether the kernels can run here, and why not.
"""
import importlib.util
import os


def available(device_type: str) -> tuple[bool, str]:
    """(True, "") when the Triton kernels can run on this device type, else (False, the reason)."""
    if device_type != "cuda":
        return False, f"Triton kernels run on CUDA devices, not {device_type}"
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    try:   # every kernel module imports it: what it takes from Triton came with Triton 3.4 (PDL's gdc_*)
        importlib.import_module("tts_kernels.launch")
    except ImportError as e:
        import triton
        return False, f"this Triton ({triton.__version__}) lacks what the kernels use: {e}"
    return True, ""


def compiled() -> bool:
    """False under Triton's interpreter (TRITON_INTERPRET=1), which has no libdevice: kernels that
    need libdevice's correctly rounded functions on the GPU use numpy's there."""
    return os.environ.get("TRITON_INTERPRET") != "1"
