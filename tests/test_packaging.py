"""Our kernels package does not shadow PyPI's `kernels`, which transformers probes for."""
import importlib.util

from transformers.utils import import_utils


def test_kernels_import_as_tts_kernels_and_transformers_sees_no_kernels_package():
    assert importlib.util.find_spec("tts_kernels") is not None
    assert not import_utils.is_kernels_available()
    spec = importlib.util.find_spec("kernels")
    # from a checkout, kernels/ may be visible as a namespace folder, never as our package
    assert spec is None or spec.origin is None
