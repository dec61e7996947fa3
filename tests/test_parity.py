"""Our plain model computes the same function as the official Qwen3-TTS (fp32, tiny checkpoints).

Stored records: made by tools/make_golden.py with the official qwen_tts package; no need for it
here. Live: the same recorder (tts_cli.quality.reference) runs the official code now, when it is
importable."""
from pathlib import Path

import pytest
import torch

from tts_cli.quality import reference
from tts_cli.quality.golden import compare, load_records
from tts_cli.synthesizer import Synthesizer

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "tts_cli" / "assets"
CASES = {
    "1.7b": (ASSETS / "tiny-1.7b-customvoice", ASSETS / "golden" / "tiny-1.7b-customvoice"),
    "0.6b": (ROOT / "tests" / "fixtures" / "tiny-0.6b-customvoice",
             ROOT / "tests" / "fixtures" / "golden" / "tiny-0.6b-customvoice"),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    ckpt, golden = CASES[request.param]
    return Synthesizer.from_pretrained(ckpt, dtype=torch.float32), golden


def _assert_all_pass(checks):
    failed = [f"{c.name}: {c.value:.3g} > {c.threshold:.3g}" for c in checks if c.failed]
    assert not failed, "\n".join(failed)
    unavailable = [c.name for c in checks if c.value is None]
    assert all(name.startswith("depth kernel vs loop") for name in unavailable), unavailable   # it needs Hopper
    assert sum(c.passed for c in checks) == len(checks) - len(unavailable)


def test_equal_to_stored_official_records(case):
    synth, golden = case
    tensors, meta = load_records(golden)
    assert len(meta["prompts"]) >= 2 and tensors["p0.greedy_codes"].shape[0] >= 20
    _assert_all_pass(compare(synth, tensors, meta))


def test_compare_fails_on_a_perturbed_record(case):
    synth, golden = case
    tensors, meta = load_records(golden)
    meta = dict(meta, prompts=meta["prompts"][:1], batch={"calls": {}})   # prompt 0 alone: the perturbed one
    tensors["p0.talker_logits"] = tensors["p0.talker_logits"] * 1.001
    tensors["p0.greedy_codes"] = tensors["p0.greedy_codes"].clone()
    tensors["p0.greedy_codes"][5, 3] = (tensors["p0.greedy_codes"][5, 3] + 1) % 2048
    failed = {c.name.split(" (")[0] for c in compare(synth, tensors, meta) if not c.passed}
    assert {"p0 talker logits", "p0 greedy codes"} <= failed


def test_equal_to_the_official_code_live(case):
    synth, golden = case
    try:
        reference.import_official()
    except ImportError as e:
        pytest.skip(f"the official implementation is not importable here: {e}")
    tensors, meta = reference.record(synth.ckpt.root)
    _assert_all_pass(compare(synth, tensors, meta))
