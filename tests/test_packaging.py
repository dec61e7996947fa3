"""Our kernels package does not shadow PyPI's `kernels`, which transformers probes for (and which
transformers 5.25 and later install as a dependency)."""
import importlib.util
from pathlib import Path

from transformers.utils import import_utils

OUR_KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def test_kernels_import_as_tts_kernels_and_never_as_kernels():
    assert importlib.util.find_spec("tts_kernels") is not None
    spec = importlib.util.find_spec("kernels")
    if spec is None or spec.origin is None:
        # none, or from a checkout our kernels/ folder seen as a namespace: transformers finds nothing
        assert not import_utils.is_kernels_available()
    else:   # PyPI's
        assert not Path(spec.origin).resolve().is_relative_to(OUR_KERNELS)
        assert Path(spec.origin).parent.name == "kernels" and "site-packages" in spec.origin
