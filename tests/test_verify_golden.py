"""`tts verify-golden`: passes on the bundled model, fails with a readable table on a perturbed record,
in float32 and in bfloat16 (the engine's numerics; on CPU the plain path with bf16 weights)."""
import json
import shutil
from pathlib import Path

import torch
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
    assert "not available: Triton kernels run on CUDA devices, not cpu" in result.output   # the depth kernel's two checks
    assert result.output.rstrip().endswith("28 checks pass, 0 fail, 2 not available")


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


def test_bfloat16_passes_on_the_bundled_model_with_the_engine_thresholds():
    result = _invoke("--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    title = " ".join(result.output.split("┏")[0].split())   # the title may wrap
    assert title.endswith("(cpu, bfloat16: bf16 weights, fp32 activations, plain torch path; codec fp32)")
    rows = {line.split("│")[1].strip(): line for line in result.output.splitlines() if line.count("│") == 5}
    assert ">= 0.9999 cosine" in rows["p0 prompt embeddings"]
    assert ">= 0.9999 cosine" in rows["p0 talker logits (teacher-forced, 21 steps)"]
    assert ">= 0.9995 cosine" in rows["p0 code-predictor logits (teacher-forced, 4 frames)"]
    assert ">= 0.9 fraction" in rows["talker logits argmax agreement (3 prompts, 63 steps)"]
    assert ">= 0.9 fraction" in rows["code-predictor logits argmax agreement (3 prompts, 12 frames x 15 heads)"]
    assert ">= 35 dB" in rows["p0 waveform"] and ">= 35 dB" in rows["codec waveform (90 frames)"]
    assert ">= 35 dB" in rows["codec streamed in chunks of 1/2/3/5/8/13 frames vs full decode"]
    greedy = rows["p0 greedy codes (20 frames x 16): frames before the first difference"]
    assert "of 20" in greedy and "information" in greedy and "info" in greedy.split("│")[4]
    assert "equal" in rows["seeded sampling, 3 rows x 20 frames, two runs"]
    assert not any("official EOS rule" in name for name in rows)   # dropped in bf16 (docs/parity.md)
    assert "FAIL" not in result.output
    assert result.output.rstrip().endswith("23 checks pass, 0 fail, 2 not available, 4 for information")


def test_bfloat16_fails_on_a_perturbed_record_with_a_readable_table(tmp_path):
    shutil.copytree(GOLDEN_06B, tmp_path, dirs_exist_ok=True)
    records = load_file(str(tmp_path / "records.safetensors"))
    embeds = records["p1.prefill_embeds"]
    noise = torch.randn(embeds.shape, generator=torch.Generator().manual_seed(0))
    records["p1.prefill_embeds"] = embeds + 0.03 * noise * embeds.norm(dim=1, keepdim=True) / embeds.shape[1] ** 0.5
    records["p0.cp_logits"] = -records["p0.cp_logits"]
    records["codec.wav"] = records["codec.wav"].flip(0)
    save_file(records, str(tmp_path / "records.safetensors"))
    result = _invoke("--model", TINY_06B, "--golden", tmp_path, "--dtype", "bfloat16")
    assert result.exit_code == 1, result.output
    failing = [line for line in result.output.splitlines() if "FAIL" in line]
    assert len(failing) == 4, result.output
    assert "p0 code-predictor logits (teacher-forced, 4 frames)" in failing[0] and "-0.99999" in failing[0]
    assert ">= 0.9995 cosine" in failing[0]
    assert "p1 prompt embeddings" in failing[1] and "0.9988789" in failing[1] and ">= 0.9999 cosine" in failing[1]
    assert "code-predictor logits argmax agreement (2 prompts, 8 frames x 15 heads)" in failing[2]
    assert "0.500" in failing[2] and ">= 0.9 fraction" in failing[2]   # p0's all flipped, p1's all agree
    assert "codec waveform (90 frames)" in failing[3] and " dB" in failing[3] and ">= 35 dB" in failing[3]
    assert result.output.splitlines()[-1] == "13 checks pass, 4 fail, 2 not available, 3 for information"


def test_refusals_name_the_reason(tmp_path):
    result = _invoke("--dtype", "float64")
    assert result.exit_code == 2 and "thresholds for float32 (our model in fp32), float16 and bfloat16" in " ".join(result.output.split())
    result = _invoke("--model", TINY_06B)
    assert result.exit_code == 2 and "--golden DIR is needed" in result.output
    result = _invoke("--model", TINY_06B, "--golden", tmp_path)
    assert result.exit_code == 2 and "lacks records.safetensors, records.json" in result.output
    result = _invoke("--record", "--model", TINY_06B)
    assert result.exit_code == 2 and "--record needs --model DIR" in result.output
    result = _invoke("--record", "--model", TINY_06B, "--out", tmp_path, "--dtype", "bfloat16")
    assert result.exit_code == 2 and "float32 only" in result.output
    result = _invoke("--frames", "8")
    assert result.exit_code == 2 and "go with --record" in result.output
    result = _invoke("--out", tmp_path)
    assert result.exit_code == 2 and "--frames, --prompts and --out go with --record" in result.output
    a_file = tmp_path / "corpus.txt"
    a_file.write_text("")
    result = _invoke("--record", "--model", TINY_06B, "--out", a_file)   # before the official model runs
    assert result.exit_code == 2 and f"--out {a_file}: a file, not a folder for the records" in result.output


def test_a_folder_without_config_json_is_refused_before_the_records_folder_is_made(tmp_path):
    """Found by the official implementation, it was a traceback after --out had been made."""
    model = tmp_path / "model"
    model.mkdir()
    out = tmp_path / "records"
    result = _invoke("--record", "--model", model, "--out", out)
    assert result.exit_code == 2 and result.stderr.splitlines() == [f"error: missing file: {model / 'config.json'}"]
    assert not out.exists()


def test_a_folder_without_its_weights_is_refused_before_the_records_folder_is_made(tmp_path):
    """An incomplete download: the official implementation found it, a traceback after --out had been made."""
    model = Path(shutil.copytree(TINY_06B, tmp_path / "model"))
    (model / "model.safetensors").unlink()
    out = tmp_path / "records"
    result = _invoke("--record", "--model", model, "--out", out)
    assert result.exit_code == 2 and result.stderr.splitlines() == [
        f"error: missing file: {model / 'model.safetensors'} (or sharded {model / 'model.safetensors.index.json'})"]
    assert not out.exists()


def test_record_without_the_reference_extra_is_refused_before_the_records_folder_is_made(tmp_path, monkeypatch):
    from tts_cli.quality import reference

    def not_installed():
        raise ModuleNotFoundError("No module named 'qwen_tts'", name="qwen_tts")

    monkeypatch.setattr(reference, "import_official", not_installed)
    out = tmp_path / "records"
    result = _invoke("--record", "--model", TINY_06B, "--out", out)
    assert result.exit_code == 2 and result.stderr.splitlines() == [
        "error: the official implementation is not importable (No module named 'qwen_tts'): install the extra "
        "[reference] (pip install -e '.[reference]' in the tts checkout: qwen-tts-hf; the Makefile names versions "
        "that work)"]
    assert not out.exists()


def test_records_of_another_kind_or_size_are_refused_before_any_check(tmp_path):
    fixtures = ROOT / "tests" / "fixtures"
    bundled_records = ROOT / "tts_cli" / "assets" / "golden" / "tiny-1.7b-customvoice"
    for model, golden, made_for, kind in (
            (TINY_06B, bundled_records, "CustomVoice 1.7B", "CustomVoice 0.6B"),
            (fixtures / "tiny-1.7b-base", fixtures / "golden" / "tiny-1.7b-voicedesign", "VoiceDesign 1.7B",
             "Base 1.7B"),
            (fixtures / "tiny-1.7b-base", fixtures / "golden" / "tiny-0.6b-base", "Base 0.6B", "Base 1.7B")):
        result = _invoke("--model", model, "--golden", golden)
        assert result.exit_code == 2, result.output
        assert f"were made for a {made_for} checkpoint, and {model} is {kind}" in " ".join(result.output.split())


def test_records_that_do_not_read_are_refused_by_name(tmp_path):
    """Exit 2 and the file (1 means a check failed), before the model loads."""
    for case, (name, content) in enumerate((("records.json", "{"), ("records.json", "[1, 2]"),
                                            ("records.safetensors", "junk"))):
        golden = tmp_path / str(case)
        shutil.copytree(GOLDEN_06B, golden)
        (golden / name).write_text(content)
        result = _invoke("--model", TINY_06B, "--golden", golden)
        assert result.exit_code == 2, result.output
        assert f"golden records {golden / name}" in "".join(result.output.split("\n")), result.output


def test_records_that_lack_a_field_or_tensor_are_refused_by_name(tmp_path):
    """Records that read but miss what the checks use: exit 2 naming the file and what is missing, not a
    traceback halfway through the checks (exit 1 would say a check failed)."""
    meta = json.loads((GOLDEN_06B / "records.json").read_text())
    no_text = json.loads(json.dumps(meta))
    del no_text["prompts"][1]["text"]
    one_more = json.loads(json.dumps(meta))
    one_more["prompts"].append(one_more["prompts"][0])
    for case, (content, name, says) in enumerate((
            ({**meta, "prompts": 5}, "records.json", "'prompts' should be a non-empty list of objects, got 5"),
            ({k: v for k, v in meta.items() if k != "prompts"}, "records.json", "'prompts' should be"),
            (no_text, "records.json", "prompt 1 lacks text"),
            ({**meta, "batch": []}, "records.json", "'batch' should be an object"),
            (one_more, "records.safetensors", "no tensor batch.greedy_codes.2, p2.cp_logits"))):
        golden = tmp_path / str(case)
        shutil.copytree(GOLDEN_06B, golden)
        (golden / "records.json").write_text(json.dumps(content))
        result = _invoke("--model", TINY_06B, "--golden", golden)
        assert result.exit_code == 2, result.output
        assert f"error: golden records {golden / name}: {says}" in "".join(result.output.split("\n")), result.output


def test_recording_over_records_json_that_does_not_read_replaces_it(tmp_path):
    from tts_cli.quality.reference import write_golden
    (tmp_path / "records.json").write_text("keep")
    write_golden(tmp_path, {"x": torch.zeros(2)}, {"kind": "test"})
    assert load_file(str(tmp_path / "records.safetensors"))["x"].tolist() == [0.0, 0.0]
    assert json.loads((tmp_path / "records.json").read_text())["kind"] == "test"
