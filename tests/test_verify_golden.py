"""`tts verify-golden`: passes on the bundled model, fails with a readable table on a perturbed record."""
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from tts_cli import cli

ROOT = Path(__file__).resolve().parents[1]
TINY_06B = ROOT / "tests" / "fixtures" / "tiny-0.6b-customvoice"
GOLDEN_06B = ROOT / "tests" / "fixtures" / "golden" / "tiny-0.6b-customvoice"
runner = CliRunner()


def _invoke(*args):
    # wide terminal: one table row per line, so the assertions can read a row whole
    return runner.invoke(cli.app, ["verify-golden", *map(str, args)], env={"COLUMNS": "200"})


def test_bundled_model_passes_its_shipped_records():
    result = _invoke()
    assert result.exit_code == 0, result.output
    assert "p0 talker logits (teacher-forced, 21 steps)" in result.output
    assert "seeded sampling" in result.output and "codec streamed" in result.output
    assert "FAIL" not in result.output
    assert "not available: no depth kernel" in result.output
    assert result.output.rstrip().endswith("28 checks pass, 0 fail, 1 not available")


def test_a_perturbed_record_fails_with_a_readable_table(tmp_path):
    shutil.copytree(GOLDEN_06B, tmp_path, dirs_exist_ok=True)
    records = load_file(str(tmp_path / "records.safetensors"))
    records["p1.prefill_embeds"] = records["p1.prefill_embeds"] * 1.01
    records["codec.wav"] = records["codec.wav"].flip(0)
    save_file(records, str(tmp_path / "records.safetensors"))
    result = _invoke("--model", TINY_06B, "--golden", tmp_path)
    assert result.exit_code == 1, result.output
    failing = [line for line in result.output.splitlines() if "FAIL" in line]
    assert len(failing) == 2, result.output
    assert "p1 prompt embeddings" in failing[0] and "9.90e-03" in failing[0] and "<= 1e-04 rel. L2" in failing[0]
    assert "codec waveform (90 frames)" in failing[1]
    assert "2 fail" in result.output.splitlines()[-1]


def test_refusals_name_the_reason(tmp_path):
    result = _invoke("--dtype", "bfloat16")
    assert result.exit_code == 2 and "bfloat16 needs its own thresholds" in result.output
    result = _invoke("--model", TINY_06B)
    assert result.exit_code == 2 and "--golden DIR is needed" in result.output
    result = _invoke("--model", TINY_06B, "--golden", tmp_path)
    assert result.exit_code == 2 and "lacks records.safetensors, records.json" in result.output
    result = _invoke("--record", "--model", TINY_06B)
    assert result.exit_code == 2 and "--record needs --model DIR" in result.output
