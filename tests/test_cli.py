"""`tts` end to end: with a fake synthesizer for the CLI's own logic, and with the bundled tiny model."""
import errno
import importlib.util
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf
import torch
from typer.testing import CliRunner

from tts_cli import __version__, cli, logs
from tts_cli.errors import CheckpointError, TTSError
from tts_cli.recipe import RECIPE_KEYS, load_recipe

from fakes import SAMPLES_PER_FRAME, checkpoint_with_empty_weights, use_fake_synthesizer

runner = CliRunner()

real_model_missing = importlib.util.find_spec("tts_cli.synthesizer") is None or not (
    cli.BUNDLED_MODEL_DIR / "config.json").is_file()
needs_real_model = pytest.mark.skipif(
    real_model_missing, reason="tts_cli/synthesizer.py or the bundled tiny model is not there yet")


@pytest.fixture
def fake(monkeypatch, tmp_path):
    return use_fake_synthesizer(monkeypatch, tmp_path)


def _invoke(*args, env=None):
    return runner.invoke(cli.app, [str(a) for a in args], env=env)


def _assert_outputs_consistent(out, report):
    """Every ok row has a 24 kHz WAV of frames * 1920 samples; report.md lists every row."""
    markdown = (out / "report.md").read_text()
    for row in report["rows"]:
        assert f"| {row['id']} |" in markdown
        if row["error"] is None:
            audio, rate = sf.read(out / row["file"])
            assert rate == 24000
            assert len(audio) == row["frames"] * SAMPLES_PER_FRAME
            assert row["audio_seconds"] == pytest.approx(len(audio) / 24000, abs=1e-3)
        else:
            assert row["file"] is None
            assert f"error: {row['error']}" in markdown
    totals = report["totals"]
    assert totals["ok"] + totals["failed"] == totals["rows"] == len(report["rows"]) and totals["not_synthesized"] == 0
    assert totals["audio_seconds"] == pytest.approx(sum(r["audio_seconds"] or 0 for r in report["rows"]), abs=1e-2)
    assert totals["xrt"] == totals["audio_seconds_per_second"]
    assert f"| {totals['ok']} | {totals['failed']} | 0 | {totals['skipped_empty']} |" in markdown
    assert "xRT = audio_seconds_this_run / wall_seconds" in markdown


def test_report_md_shows_a_rows_markup_as_text(fake, tmp_path):
    """Markdown passes raw HTML through: a row's text with markup is written as entities in
    report.md (as report.html escapes it), so a viewer shows it and runs nothing."""
    manifest = tmp_path / "m.txt"
    manifest.write_text("tagged\t<b>Bold</b> & <script>alert(1)</script> | done.\n")
    result = _invoke("synth", manifest, "--out", tmp_path / "out", "--model", tmp_path / "model")
    assert result.exit_code == 0, result.output
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "&lt;b&gt;Bold&lt;/b&gt; &amp; &lt;script&gt;alert(1)&lt;/script&gt; \\| done." in markdown
    assert "<script>" not in markdown and "<b>" not in markdown


def test_report_md_keeps_a_row_on_its_table_line_whatever_its_control_characters(fake, tmp_path):
    """A lone CR is a line end to markdown: a row's text with one (allowed in text) would break the
    table; other control characters (in failed rows' text) are written as \\xNN, not raw."""
    manifest = tmp_path / "m.txt"
    manifest.write_bytes(b"cr\tline one\rline two.\nesc\t\x1b[31mred\n")
    result = _invoke("synth", manifest, "--out", tmp_path / "out", "--model", tmp_path / "model")
    assert result.exit_code == 1, result.output   # the ESC row fails
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "\r" not in markdown and "\x1b" not in markdown
    row_lines = [line for line in markdown.split("\n") if line.startswith(("| 1 | cr |", "| 2 | esc |"))]
    assert len(row_lines) == 2 and "line one line two." in row_lines[0] and "\\\\x1b[31mred" in row_lines[1]


def test_synth_writes_a_wav_per_row_and_both_reports(fake, tmp_path):
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello there.\n\nsecond\tGood bye.\nspaced out\tNot outside.\n")
    out = tmp_path / "out"
    result = _invoke("synth", manifest, "--out", out, "--model", tmp_path / "model", "--batch-size", 2)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert [(r["id"], r["file"]) for r in report["rows"]] == [
        ("000001", "000001.wav"), ("second", "second.wav"), ("spaced out", "spaced_out.wav")]
    assert sorted(p.name for p in out.iterdir()) == [
        ".tts-lock", "000001.wav", "ledger.jsonl", "report.html", "report.json", "report.md", "second.wav",
        "spaced_out.wav"]
    assert report["totals"]["skipped_empty"] == 1
    assert report["model"] == {"dir": str(tmp_path / "model"), "source": "--model", "bundled_random_model": False}
    assert report["dtype"] == fake.numerics   # what the loaded model computes in, not what was asked for
    assert fake.batches == [["000001", "second"], ["spaced out"]]
    _assert_outputs_consistent(out, report)
    assert "3 rows ok (0 from an earlier run), 0 failed, 1 empty skipped" in result.stdout


def test_invalid_rows_fail_with_the_valid_values_and_others_go_on(fake, tmp_path):
    manifest = tmp_path / "m.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c", "d"], "text": ["One.", "Two.", "Three boom.", "Four."],
                             "speaker": [None, "nobody", None, None],
                             "language": [None, None, None, "klingon"]}), manifest)
    out = tmp_path / "out"
    result = _invoke("synth", manifest, "--out", out, "--model", tmp_path / "model")
    assert result.exit_code == 1, result.output
    report = json.loads((out / "report.json").read_text())
    errors = {r["id"]: r["error"] for r in report["rows"]}
    assert errors == {"a": None, "b": "unknown speaker 'nobody'; valid: ryan, vivian",
                      "c": "boom is not speakable", "d": "unknown language 'klingon'; valid: auto, chinese, english"}
    # The failing batch is retried row by row, so its good row still gets audio.
    assert fake.batches == [["a", "c"], ["a"], ["c"]]
    assert "row 2 ('b'): unknown speaker 'nobody'; valid: ryan, vivian" in result.stderr
    _assert_outputs_consistent(out, report)


def test_max_frames_and_greedy_reach_the_synthesizer_and_the_report(fake, tmp_path, monkeypatch):
    seen = {}
    synthesize = fake.synthesize

    def spy(requests, greedy=False, max_frames=None, max_rows=None, **streaming):
        seen.update(greedy=greedy, max_frames=max_frames, seeds=[r.seed for r in requests])
        return synthesize(requests, greedy=greedy, max_frames=max_frames, max_rows=max_rows, **streaming)

    monkeypatch.setattr(fake, "synthesize", spy)
    manifest = tmp_path / "m.txt"
    manifest.write_text("A long enough sentence.\n\nAnother.\n")
    out = tmp_path / "out"
    result = _invoke("synth", manifest, "--out", out, "--model", tmp_path / "model",
                     "--greedy", "--max-frames", 3, "--seed", 40)
    assert result.exit_code == 0, result.output
    assert seen == {"greedy": True, "max_frames": 3, "seeds": [40, 42]}
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["greedy"] is True and report["settings"]["max_frames"] == 3
    assert all(r["frames"] <= 3 for r in report["rows"])


def test_bundled_model_is_used_with_a_random_weights_warning(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "BUNDLED_MODEL_DIR", tmp_path / "model")
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello.\n")
    result = _invoke("synth", manifest, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "random weights: its audio is noise; pass --model or set TTS_MODEL" in result.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["model"]["bundled_random_model"] is True
    assert "random weights: its audio is noise" in (tmp_path / "out" / "report.md").read_text()


def test_model_option_wins_over_env_and_env_over_bundled(tmp_path, monkeypatch):
    monkeypatch.setenv("TTS_MODEL", str(tmp_path))
    assert cli.resolve_model(None).source == "$TTS_MODEL"
    assert cli.resolve_model(tmp_path).source == "--model"
    monkeypatch.setenv("TTS_MODEL", "")
    monkeypatch.setattr(cli, "BUNDLED_MODEL_DIR", tmp_path)
    assert cli.resolve_model(None).source == "bundled"


def _assert_one_red_line(result, message):
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert result.stderr.splitlines() == [f"error: {message}"]


def test_missing_model_dir_names_the_path(fake, tmp_path):
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello.\n")
    result = _invoke("synth", manifest, "--out", tmp_path / "out", "--model", tmp_path / "no-such-model")
    _assert_one_red_line(result, f"model directory not found: {tmp_path / 'no-such-model'} (from --model)")
    assert not (tmp_path / "out").exists()


def test_missing_tts_model_dir_names_the_path_and_the_variable(fake, tmp_path):
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello.\n")
    result = _invoke("synth", manifest, "--out", tmp_path / "out", env={"TTS_MODEL": str(tmp_path / "gone")})
    _assert_one_red_line(result, f"model directory not found: {tmp_path / 'gone'} (from $TTS_MODEL)")
    assert not (tmp_path / "out").exists()


def test_on_cuda_calls_carry_sixteen_times_the_engine_rows(fake, tmp_path, monkeypatch):
    # (the device check is skipped: this machine may have no GPU; the fake synthesizer needs none)
    monkeypatch.setattr(cli, "check_device", lambda device, given_by: None)
    manifest = tmp_path / "m.txt"
    manifest.write_text("".join(f"Sentence {i}.\n" for i in range(50)))
    result = _invoke("synth", manifest, "--out", tmp_path / "out", "--model", tmp_path / "model",
                     "--device", "cuda", "--rows", 3, "--codec-precision", "fp32", "--talker-precision", "bf16")
    assert result.exit_code == 0, result.output
    assert fake.loaded_with == {"device": "cuda", "engine_rows": 3, "depth": "auto", "codec_precision": "fp32",
                                "talker_precision": "bf16"}
    assert [len(batch) for batch in fake.batches] == [48, 2] and fake.max_rows == [48, 48]
    result = _invoke("synth", manifest, "--out", tmp_path / "out-cpu", "--model", tmp_path / "model", "--rows", 3,
                     "--depth", "loop", "--talker-precision", "bf16")
    assert [len(batch) for batch in fake.batches[2:]] == [8] * 6 + [2]   # cpu: 8 per call, whatever --rows
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert warnings == ["warning: --rows 3, --depth loop, --talker-precision bf16 ignored: they set the CUDA engine, "
                        "and this run is on cpu"]
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rows: 64\ncodec_precision: fp32\n")
    result = _invoke("synth", manifest, "--out", tmp_path / "out-recipe", "--model", tmp_path / "model",
                     "--recipe", recipe)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert warnings == [f"warning: rows 64 (recipe {recipe}), codec_precision fp32 (recipe {recipe}) ignored: they "
                        "set the CUDA engine, and this run is on cpu"]
    result = _invoke("synth", manifest, "--out", tmp_path / "out-rows", "--model", tmp_path / "model", "--rows", 3)
    assert "warning: --rows 3 ignored: it sets the CUDA engine, and this run is on cpu" in result.stderr.splitlines()


def test_with_gpus_the_default_call_gives_every_gpu_work(fake, tmp_path, monkeypatch):
    """16 x 512 segments a call took a corpus of fewer segments whole to one worker (batches go to the
    free worker): with --gpus a call holds at most the rows over twice the workers."""
    from tts_cli.errors import TTSError
    from tts_cli.scale import workers

    def pool(model_dir, devices, settings, voices):   # stops the run, saying how the calls were sized
        raise TTSError(f"calls of {settings.batch_size} segments on {len(devices)} workers")

    monkeypatch.setattr(workers, "check_devices", lambda devices: None)
    monkeypatch.setattr(workers, "WorkerPool", pool)
    manifest = tmp_path / "m.txt"
    manifest.write_text("".join(f"Sentence {i}.\n" for i in range(100)))
    result = _invoke("synth", manifest, "--out", tmp_path / "out", "--model", tmp_path / "model", "--gpus", "0,1,2,3")
    assert "calls of 13 segments on 4 workers" in result.stderr, result.output
    result = _invoke("synth", manifest, "--out", tmp_path / "out2", "--model", tmp_path / "model", "--gpus", "0,1",
                     "--batch-size", 60)
    assert "calls of 60 segments on 2 workers" in result.stderr, result.output


def test_rows_auto_is_the_default_and_a_bad_rows_value_is_one_red_line(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "check_device", lambda device, given_by: None)
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello.\n")
    result = _invoke("synth", manifest, "--out", tmp_path / "out", "--model", tmp_path / "model", "--device", "cuda")
    assert result.exit_code == 0, result.output
    assert fake.loaded_with["engine_rows"] is None   # the synthesizer chooses per call
    assert fake.max_rows == [16 * 1024]              # calls sized for the most slots auto may choose
    assert "rows: auto (the most slots of 1024, 512, 256, 128, 64" in result.stderr
    fake.notes.append("--rows auto: 64 engine slots for calls of 1 segments (up to 60 talker positions)")
    result = _invoke("synth", manifest, "--out", tmp_path / "out1", "--model", tmp_path / "model", "--device", "cuda")
    notes = json.loads((tmp_path / "out1" / "report.json").read_text())["notes"]
    assert notes.count(fake.notes[0]) == 1 and result.stderr.count(fake.notes[0]) == 1   # the choice, once
    result = _invoke("synth", manifest, "--out", tmp_path / "out2", "--model", tmp_path / "model", "--rows", "0",
                     "--device", "cpu")
    _assert_one_red_line(result, "--rows 0: auto or a whole number of slots (1 or more)")


def test_recipe_rows_may_be_a_number_or_auto(tmp_path):
    from tts_cli.recipe import load_recipe, parse_rows
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rows: 128\n")
    assert parse_rows(load_recipe(str(recipe))["rows"]) == 128
    recipe.write_text("rows: auto\n")
    assert parse_rows(load_recipe(str(recipe))["rows"]) is None
    recipe.write_text("rows: many\n")
    with pytest.raises(TTSError, match="'rows' many: auto or a whole number of slots"):
        load_recipe(str(recipe))


@pytest.mark.parametrize("option, value, choices", [("--codec-precision", "bf16", "fp16, fp32"),
                                                    ("--talker-precision", "fp32", "fp16, bf16")])
def test_unknown_precision_is_refused_with_the_choices(fake, tmp_path, option, value, choices):
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello.\n")
    result = _invoke("synth", manifest, "--out", tmp_path / "out", "--model", tmp_path / "model", option, value)
    _assert_one_red_line(result, f"{option} {value}: one of {choices}")


def test_bad_manifest_fails_before_the_model_loads(tmp_path, monkeypatch):
    def must_not_load(model_dir, device, engine_rows=None):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "load_synthesizer", must_not_load)
    checkpoint_with_empty_weights(tmp_path / "model")
    manifest = tmp_path / "m.parquet"
    pq.write_table(pa.table({"id": ["a"]}), manifest)
    result = _invoke("synth", manifest, "--out", tmp_path / "out", "--model", tmp_path / "model")
    _assert_one_red_line(result, f"{manifest}: missing required column 'text' (columns present: id)")
    assert not (tmp_path / "out").exists()


def test_manifest_of_empty_lines_is_an_error(fake, tmp_path):
    manifest = tmp_path / "m.txt"
    manifest.write_text("\n  \n")
    result = _invoke("synth", manifest, "--out", tmp_path / "out", "--model", tmp_path / "model")
    _assert_one_red_line(result, f"{manifest}: no non-empty rows (2 empty rows skipped)")


def test_checkpoint_error_is_one_red_line(tmp_path, monkeypatch):
    def broken(model_dir, device, engine_rows=None, depth=None, codec_precision=None, talker_precision=None):
        raise CheckpointError(f"{model_dir / 'config.json'}: not valid JSON")

    monkeypatch.setattr(cli, "load_synthesizer", broken)
    checkpoint_with_empty_weights(tmp_path / "model")
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello.\n")
    result = _invoke("synth", manifest, "--out", tmp_path / "out", "--model", tmp_path / "model")
    assert result.exit_code == 2 and "Traceback" not in result.output
    # the model loads after the device is chosen and said
    assert result.stderr.splitlines() == [cli.resolve_device("auto").line(),
                                          f"error: {tmp_path / 'model' / 'config.json'}: not valid JSON"]


@pytest.mark.parametrize("given_by", ["--model", "$TTS_MODEL"])
@pytest.mark.parametrize("existing_out", [False, True])
@pytest.mark.parametrize("broken", ["not JSON", "missing a field", "absent"])
def test_a_broken_checkpoint_config_stops_the_run_before_the_output_folder_is_touched(tmp_path, monkeypatch, broken,
                                                                                     existing_out, given_by):
    """Before the model loads and before --out is made or locked (found at load, it came after .tts-lock and
    ledger.jsonl were written there)."""
    def must_not_load(model_dir, device, engine_rows=None, depth=None, codec_precision=None, talker_precision=None):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "load_synthesizer", must_not_load)
    monkeypatch.delenv("TTS_MODEL", raising=False)
    config = checkpoint_with_empty_weights(tmp_path / "model") / "config.json"
    if broken == "not JSON":
        config.write_text("{")
    elif broken == "missing a field":
        fields = json.loads(config.read_text())
        del fields["tts_model_type"]
        config.write_text(json.dumps(fields))
    else:
        config.unlink()
    out = tmp_path / "out"
    if existing_out:
        out.mkdir()
        (out / "notes.txt").write_text("not tts's")
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello.\n")
    if given_by == "--model":
        result = _invoke("synth", manifest, "--out", out, "--model", tmp_path / "model", "--no-wer")
    else:
        result = _invoke("synth", manifest, "--out", out, "--no-wer", env={"TTS_MODEL": str(tmp_path / "model")})
    assert result.exit_code == 2 and "Traceback" not in result.output
    [error] = result.stderr.splitlines()
    assert error.startswith({"not JSON": f"error: malformed JSON in {config}: ",
                             "missing a field": f"error: {config}: missing field 'tts_model_type'",
                             "absent": f"error: missing file: {config}"}[broken])
    if existing_out:
        assert [path.name for path in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "not tts's"
    else:
        assert not out.exists()


@pytest.mark.parametrize("missing", ["model.safetensors", "a shard", "speech_tokenizer/model.safetensors",
                                     "speech_tokenizer/config.json"])
def test_a_checkpoint_missing_a_weights_file_stops_the_run_before_the_output_folder_is_made(tmp_path, monkeypatch,
                                                                                           missing):
    """An incomplete download: found at load, it came after .tts-lock and ledger.jsonl were written into --out."""
    def must_not_load(model_dir, device, engine_rows=None, depth=None, codec_precision=None, talker_precision=None):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "load_synthesizer", must_not_load)
    model = checkpoint_with_empty_weights(tmp_path / "model")
    if missing == "a shard":
        (model / "model.safetensors").unlink()
        index = model / "model.safetensors.index.json"
        shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        index.write_text(json.dumps({"weight_map": {"talker.a": shards[0], "talker.b": shards[1]}}))
        (model / shards[0]).touch()
        message = f"missing file: {model / shards[1]} (listed in {index})"
    else:
        (model / missing).unlink()
        message = f"missing file: {model / missing}"
        if missing == "model.safetensors":
            message += f" (or sharded {model / 'model.safetensors.index.json'})"
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello.\n")
    result = _invoke("synth", manifest, "--out", tmp_path / "out", "--model", model, "--no-wer")
    _assert_one_red_line(result, message)
    assert not (tmp_path / "out").exists()


def test_a_rerun_with_nothing_to_do_prints_no_empty_line(fake, tmp_path):
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello.\n")
    arguments = ("synth", manifest, "--out", tmp_path / "out", "--model", tmp_path / "model", "--no-wer")
    assert _invoke(*arguments).exit_code == 0
    rerun = _invoke(*arguments)
    assert rerun.exit_code == 0 and "1 rows ok (1 from an earlier run)" in rerun.stdout
    assert "" not in rerun.stderr.splitlines()


@pytest.mark.parametrize("device, message", [
    *[(d, f"device '{d}' (--device): auto, cpu, cuda or cuda:N")
      for d in ("toaster", "mps", "xpu", "meta", "CPU", "cpu:0", "cuda:x", "cuda:", "cuda:١", "cuda:²")],
    pytest.param("cuda", "device 'cuda' (--device): torch reports no CUDA device on this machine",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
    pytest.param("cuda:7", "device 'cuda:7' (--device): torch reports no CUDA device on this machine",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
])
def test_unusable_device_is_one_red_line(fake, tmp_path, device, message):
    """Only the devices tts runs on: torch would take mps, xpu or meta and fail later with a traceback."""
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello.\n")
    result = _invoke("synth", manifest, "--out", tmp_path / "out", "--model", tmp_path / "model", "--device", device)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {message}")
    assert "Traceback" not in result.output


def test_bench_runs_the_engine_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    result = _invoke("bench", "--device", "cpu", "--model", cli.BUNDLED_MODEL_DIR, "--concurrency", "1,2",
                     "--requests", "3", "--frames", "5", "--codec-window", "2", "--json", out)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [r["concurrency"] for r in report["rows"]] == [1, 2]
    assert all(r["frames"] == 3 * 5 and r["requests"] == 3 for r in report["rows"])
    for r in report["rows"]:   # the share of slot-steps that made a frame
        assert 0 < r["slots_busy"] <= 1 and r["slots_busy"] == round(r["frames"] / (r["steps"] * r["concurrency"]), 3)
    assert report["forced_length"] and report["dtype"] == "float32" and report["codec_window"] == 2
    from tts_cli.bench_plot import runs_from   # on CPU the weights are fp32, whatever --talker-precision says
    assert report["talker_precision"] is None and runs_from(report, "b")[0].label.endswith(" fp32 (CPU)")
    assert report["codec_precision"] is None   # the CPU's vocoder is fp32 too
    assert report["sentences"] == "bundled harvard-sentences.txt" and report["sentence_count"] == 360
    assert "audio-s/s" in result.stdout and "busy: share of slot-steps (a tail step's rows) that made" in " ".join(result.stdout.split())


@pytest.mark.parametrize("concurrency", [1, 4])
def test_bench_warmup_admits_groups_of_every_kind_the_run_has(monkeypatch, concurrency):
    """The warmup admits all slots at once, then one prompt, then three (up to the slots), so that
    no Triton kernel meets a group size for the first time in the measured run."""
    from tts_cli import bench
    from tts_cli.engine.runner import Engine
    groups = []
    prefill = Engine._prefill
    monkeypatch.setattr(Engine, "_prefill", lambda self, admitted: (groups.append(len(admitted)),
                                                                     prefill(self, admitted))[1])
    synth = bench.load_synthesizer(str(cli.BUNDLED_MODEL_DIR), "cpu", torch.float32)
    requests = bench.make_requests(synth, bench.read_sentences(bench.SENTENCES)[:2], 2, 5, "vivian")
    bench.warm_engine(synth, concurrency, requests, codec_window=2)
    assert groups[0] == concurrency and 1 in groups[1:] and sum(groups) == concurrency + 4
    if concurrency >= 3:
        assert 3 in groups


def test_bench_warmup_runs_every_prefill_tile_size(monkeypatch):
    """Each prefill tile size has a graph of its own, captured when first run: the warmup runs a tile
    of every size the engine has (128, 64 and 32 tokens here), so the measured run captures none."""
    from tts_cli import bench
    from tts_cli.engine.prefill import Prefill
    tiles = []
    tile = Prefill._tile
    monkeypatch.setattr(Prefill, "_tile", lambda self, size, inputs: (tiles.append(size), tile(self, size, inputs))[1])
    synth = bench.load_synthesizer(str(cli.BUNDLED_MODEL_DIR), "cpu", torch.float32)
    requests = bench.make_requests(synth, bench.read_sentences(bench.SENTENCES)[:2], 2, 5, "vivian")
    bench.warm_engine(synth, 16, requests, codec_window=2, prefill_tiles=(128, 64, 32))
    assert set(tiles) == {128, 64, 32} and tiles[-3:] == [128, 64, 32]


@pytest.mark.parametrize("flag, engine_gets, setting", [(None, None, "own stream on CUDA up to 64 rows, else in line"),
                                                        ("--codec-in-line", False, "in line")])
def test_bench_codec_stream_switch_reaches_the_engine(monkeypatch, tmp_path, flag, engine_gets, setting):
    """--codec-in-line asks the engine for the codec in line; by default the engine chooses (its own
    stream on CUDA up to 64 rows). The CPU runs it in line either way."""
    from tts_cli.engine.runner import Engine
    asked = []
    init = Engine.__init__
    monkeypatch.setattr(Engine, "__init__", lambda self, *a, **kw: (asked.append(kw.get("codec_stream", "absent")),
                                                                   init(self, *a, **kw))[1])
    out = tmp_path / "bench.json"
    result = _invoke("bench", "--device", "cpu", "--model", cli.BUNDLED_MODEL_DIR, "--concurrency", "1",
                     "--requests", "1", "--frames", "3", "--json", out, *([flag] if flag else []))
    assert result.exit_code == 0, result.output
    assert asked and all(a is engine_gets for a in asked)
    report = json.loads(out.read_text())
    assert report["codec_stream_setting"] == setting and report["rows"][0]["codec_stream"] is False


def test_bench_order_longest_queues_the_longest_requests_first(tmp_path):
    """--order longest: the slot model (tools/slot_occupancy.py, held to the engine) takes as many
    steps as the engine did for the requests' lengths sorted longest first; given: in their order."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from slot_occupancy import bench_lengths, simulate
    steps = {}
    for order in ("given", "longest"):
        out = tmp_path / f"{order}.json"
        result = _invoke("bench", "--device", "cpu", "--model", cli.BUNDLED_MODEL_DIR, "--concurrency", "3",
                         "--requests", "10", "--codec-window", "4", "--order", order, "--json", out)
        assert result.exit_code == 0, result.output
        report = json.loads(out.read_text())
        assert report["order"] == order
        steps[order] = report["rows"][0]["steps"]
        assert ("--order longest: each level's requests were queued longest first" in result.stdout) == (
            order == "longest")
    lengths = bench_lengths(10)
    assert steps["given"] == simulate(lengths, 3)["steps"]
    assert steps["longest"] == simulate(sorted(lengths, reverse=True), 3)["steps"]
    assert steps["given"] != steps["longest"]
    result = _invoke("bench", "--device", "cpu", "--order", "shortest")
    assert result.exit_code == 2 and "--order shortest: one of given, longest" in result.stderr
    assert "device:" not in result.output   # refused before anything is said or loaded


def test_bench_ref_seconds_within_the_references_limits_and_said_to_be_ignored_without_a_clone(tmp_path):
    result = _invoke("bench", "--device", "cpu", "--workload", "clone-icl", "--ref-seconds", "61")
    _assert_one_red_line(result, "--ref-seconds 61: a finite number of seconds from 1 to 60")
    result = _invoke("bench", "--device", "cpu", "--concurrency", "1", "--frames", "8", "--requests", "1",
                     "--ref-seconds", "3", "--json", tmp_path / "b.json")
    assert result.exit_code == 0, result.output
    assert "warning: --ref-seconds 3 is ignored: the customvoice workload clones no voice" in result.output


def test_bench_refuses_a_ref_seconds_that_is_no_finite_number():
    """typer's bounds refused nan and inf as above 60 and -inf as below 1: one red line says what the option
    takes, before anything runs (also for the workload that ignores it)."""
    for value, read_as in (("nan", "nan"), ("inf", "inf"), ("-inf", "-inf"), ("NaN", "nan"), ("1e400", "inf")):
        for workload in ("clone-icl", "customvoice"):
            result = _invoke("bench", "--device", "cpu", "--workload", workload, "--ref-seconds", value)
            _assert_one_red_line(result, f"--ref-seconds {read_as}: a finite number of seconds from 1 to 60")


def test_bench_refuses_a_folder_without_config_json_before_it_makes_the_results_folder(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    result = _invoke("bench", "--device", "cpu", "--model", model, "--json", tmp_path / "results" / "bench.json")
    _assert_one_red_line(result, f"missing file: {model / 'config.json'}")
    assert not (tmp_path / "results").exists()


def test_bench_refuses_a_folder_without_its_codec_weights_before_it_makes_the_results_folder(tmp_path):
    model = checkpoint_with_empty_weights(tmp_path / "model")
    (model / "speech_tokenizer" / "model.safetensors").unlink()
    result = _invoke("bench", "--device", "cpu", "--model", model, "--json", tmp_path / "results" / "bench.json")
    _assert_one_red_line(result, f"missing file: {model / 'speech_tokenizer' / 'model.safetensors'}")
    assert not (tmp_path / "results").exists()


def test_gpus_names_where_the_device_it_replaces_came_from(tmp_path, monkeypatch):
    """--gpus replaces --device: the device line (and the report) says which device is not used, and where it
    came from: a recipe's (the shipped ones set device: cuda) is not called --device."""
    lines = []

    def stop(plan, options, report_row_error):   # the device line, then no run
        lines.append(plan.device_choice.line())
        raise TTSError("stopped")

    monkeypatch.setattr(cli, "say_run_start", stop)
    manifest, recipe = tmp_path / "m.txt", tmp_path / "r.yaml"
    manifest.write_text("Hello.\n")
    recipe.write_text("device: cuda\n")
    for args in (["--recipe", recipe], ["--device", "cuda"], ["--recipe", recipe, "--device", "cuda:0"]):
        _invoke("synth", manifest, "--out", tmp_path / "out", "--no-wer", "--gpus", "cpu,cpu", *args)
    assert lines == [f"device: cpu,cpu (--gpus: one worker per device; device cuda (recipe {recipe}) not used)",
                     "device: cpu,cpu (--gpus: one worker per device; --device cuda not used)",
                     "device: cpu,cpu (--gpus: one worker per device; --device cuda:0 not used)"]


def test_a_max_frames_beyond_64_bits_is_refused_before_the_run(tmp_path):
    """It passed the option's bounds and failed the run mid-synthesis ("Overflow when unpacking long long",
    exit 2, with --out made): now the option's own bounds refuse it, before the model loads."""
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello.\n")
    result = _invoke("synth", manifest, "--out", tmp_path / "out", "--no-wer", "--max-frames", 2**63)
    assert result.exit_code == 2 and "Invalid value for '--max-frames'" in result.stderr, result.output
    assert "9223372036854775807" in result.stderr and not (tmp_path / "out").exists()


def test_bench_rejects_bad_options():
    for option, value in (("--concurrency", "1,x"), ("--concurrency", "0"), ("--concurrency", "4,-1"),
                          ("--concurrency", ""), ("--frames", "0"), ("--frames", "x"),
                          # other scripts' digits, which int() reads: ASCII digits only, as --rows and --shard
                          ("--concurrency", "\u0661"), ("--concurrency", "1,\u0664"), ("--frames", "\u0668"),
                          ("--frames", "\u00b2")):
        result = _invoke("bench", "--device", "cpu", option, value)
        # the option at fault and its value, not both options' rules
        takes = "takes positive integers like 1,8,64" if option == "--concurrency" else "takes auto or a positive integer"
        assert result.exit_code == 2 and f"{option} {value}: {takes}" in " ".join(result.stderr.split()), \
            (option, value, result.output)
    result = _invoke("bench", "--device", "cpu", "--model", "random:7b")
    assert result.exit_code == 2 and "unknown random model 'random:7b'" in result.stderr
    result = _invoke("bench", "--device", "cpu", "--codec-window", "1000000")
    assert result.exit_code == 2 and "Traceback" not in result.output and "less than or equal to 64" in result.output


def test_an_output_folder_or_model_folder_that_is_a_file_is_named_as_a_file(tmp_path):
    manifest = tmp_path / "m.txt"
    manifest.write_text("a\tHello there.\n")
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    result = _invoke("synth", manifest, "--out", a_file, "--no-wer")
    _assert_one_red_line(result, f"--out {a_file}: a file, not a folder (give a folder for the audio and report)")
    result = _invoke("synth", manifest, "--out", tmp_path / "out", "--model", a_file, "--no-wer")
    _assert_one_red_line(result, f"not a model folder: {a_file} is a file (from --model); give the folder of "
                                 "config.json")


def test_a_results_folder_that_cannot_be_written_is_named_not_the_probe_file(monkeypatch, tmp_path):
    """The check before the run writes a temporary file there; its random name was the one the error gave."""
    import tempfile

    def read_only(dir=None, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(Path(dir) / "tmpha3mkqi1"))

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    out = tmp_path / "bench.json"
    result = _invoke("bench", "--device", "cpu", "--json", out)
    _assert_one_red_line(result, f"cannot write the results {out}: Read-only file system (in its folder {tmp_path})")


def test_bench_says_what_it_cannot_read_or_write_before_it_runs(tmp_path):
    """One red line, exit 2, before any model loads or any concurrency runs: the sentences missing or
    empty, a results or plot path that cannot be written, a workload the model cannot run."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    (tmp_path / "empty.txt").write_text("\n  \n")
    cases = [
        (["--sentences", tmp_path / "missing.txt"], f"cannot read the sentences {tmp_path / 'missing.txt'}"),
        (["--sentences", tmp_path / "empty.txt"], f"{tmp_path / 'empty.txt'}: no sentences (one per line)"),
        (["--json", tmp_path], f"cannot write the results {tmp_path}: it is a folder"),
        (["--json", blocker / "b.json"], f"cannot write the results {blocker / 'b.json'}"),
        (["--plot", blocker / "p.png"], f"cannot write the plot {blocker / 'p.png'}"),
        (["--workload", "clone-icl"], f"--workload clone-icl needs a Base checkpoint, and {cli.BUNDLED_MODEL_DIR} is "
                                      "CustomVoice (the bundled tiny model, the default on cpu): give --model "
                                      "random:0.6b or a Base checkpoint folder"),
    ]
    for args, message in cases:
        result = _invoke("bench", "--device", "cpu", "--concurrency", "1", "--requests", "1", "--frames", "3",
                         *(["--json", tmp_path / "r.json"] if "--json" not in args else []), *args)
        assert result.exit_code == 2 and "Traceback" not in result.output, (args, result.output)
        assert message in " ".join(result.stderr.split()), (args, result.stderr)
        assert "audio-s/s" not in result.stdout and not (tmp_path / "r.json").exists(), args


def test_version_and_help():
    assert _invoke("--version").stdout.strip() == f"tts {__version__}"
    help_text = _invoke("synth", "--help").output
    assert "1 some rows failed" in help_text and "--max-frames" in help_text


def test_plot_short_help_names_every_format_it_writes():
    """tts --help's line for plot names each format --out takes (bench_plot.PLOT_FORMATS), not PNG alone."""
    from tts_cli.bench_plot import PLOT_FORMATS

    help_text = " ".join(_invoke("--help").output.split())
    line = help_text[help_text.index("plot Draw"):help_text.index("score Score")]
    assert all(suffix[1:].upper() in line for suffix in PLOT_FORMATS), line


def test_verify_golden_record_help_says_where_it_records():
    """--record runs the official implementation on --device, whose default auto is cuda where torch sees a GPU
    (run_verify_golden: resolve_device): its help must not say it records on cpu unless --device cuda is given."""
    help_text = " ".join(_invoke("verify-golden", "--help").output.split())
    record = help_text[help_text.index("--record Write"):help_text.index("--out DIR")]
    assert "on cpu, or with --device cuda" not in record
    assert "--device" in record and "auto" in record


@needs_real_model
def test_bundled_model_end_to_end(tmp_path, monkeypatch):
    monkeypatch.delenv("TTS_MODEL", raising=False)
    manifest = tmp_path / "m.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c", "d"],
                             "text": ["The birch canoe slid on the smooth planks.", "Hello.", "", "Rice bowls."],
                             "speaker": [None, "nobody", None, None],
                             "language": [None, None, None, "english"]}), manifest)
    out = tmp_path / "out"
    result = _invoke("-v", "synth", manifest, "--out", out, "--max-frames", 6, "--batch-size", 2)
    assert result.exit_code == 1, result.output
    assert "random weights: its audio is noise" in result.stderr
    assert "tts: synthesis path: plain model (cpu: the slot engine" in result.stderr   # --verbose: the path taken
    assert not logs.verbose()   # removed when the command ended
    report = json.loads((out / "report.json").read_text())
    rows = {r["id"]: r for r in report["rows"]}
    assert rows.keys() == {"a", "b", "c", "d"}
    assert rows["a"]["error"] is None and rows["d"]["error"] is None
    assert "nobody" in rows["b"]["error"] and "vivian" in rows["b"]["error"]
    assert rows["c"]["error"] == "empty text"    # a parquet row is a row, even without text
    assert 1 <= rows["a"]["frames"] <= 6
    assert report["model"]["bundled_random_model"] is True
    _assert_outputs_consistent(out, report)


def test_recipe_fills_the_options_not_given_on_the_command_line(fake, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {tmp_path / 'model'}\nbatch_size: 1\nmax_frames: 3\nspeaker: ryan\n")
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello there.\nGood bye.\n")
    out = tmp_path / "out"
    result = _invoke("synth", manifest, "--out", out, "--recipe", recipe, "--speaker", "vivian")
    assert result.exit_code == 0, result.output
    assert fake.batches == [["000001"], ["000002"]]                 # batch_size from the recipe
    report = json.loads((out / "report.json").read_text())
    assert {r["speaker"] for r in report["rows"]} == {"vivian"}     # the command line wins
    assert all(r["frames"] <= 3 for r in report["rows"])            # max_frames from the recipe


def test_recipe_model_bundled_warns_about_random_weights(fake, tmp_path):
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello there.\n")
    result = _invoke("synth", manifest, "--out", tmp_path / "out", "--recipe", "tiny")
    assert result.exit_code == 0, result.output
    assert "random weights" in result.stderr
    assert json.loads((tmp_path / "out" / "report.json").read_text())["model"]["bundled_random_model"]


@pytest.mark.parametrize("content, message", [
    ("bogus: 1\n", "unknown key 'bogus'"),
    ("bogus: null\n", "unknown key 'bogus'"),   # a null is the default of a known key only
    ("batch_size: many\n", "'batch_size' should be int"),
    ("[1, 2]\n", "expected a mapping"),
    # the command line's bounds hold for a recipe's values too
    ("max_frames: 0\n", "'max_frames' should be from 1 to 9223372036854775807, got 0"),
    ("max_frames: -4\n", "'max_frames' should be from 1 to 9223372036854775807, got -4"),
    ("max_frames: 9223372036854775808\n",
     "'max_frames' should be from 1 to 9223372036854775807, got 9223372036854775808"),
    ("batch_size: 0\n", "'batch_size' should be 1 or more, got 0"),
    ("batch_size: -2\n", "'batch_size' should be 1 or more, got -2"),
    ("seed: 9223372036854775808\n", "'seed' should be from -9223372036854775808 to 9223372036854775807"),
    (b"\xff\xfe\x00", "does not read as UTF-8 text"),
    ("depth: bogus\n", "'depth' should be one of auto, kernel, loop, got 'bogus'"),
    ("model: /nonexistent/model\n", "model directory not found: /nonexistent/model (from recipe "),
    ("model: ''\n", "'model' is empty (leave it out, or give null, for the default)"),
    ("device: '  '\n", "'device' is empty (leave it out, or give null, for the default)"),
    ("rows: 0\n", "'rows' 0: auto or a whole number of slots (1 or more)"),
    ("rows: '²'\n", "'rows' ²: auto or a whole number of slots (1 or more)"),
    ("speaker: [vivian\n", "malformed YAML in recipe"),
    ("max_frames: 3\nseed: 1\nmax_frames: 4\n", "found duplicate key 'max_frames' (first on line 1)"),
    ("? [seed]\n: 1\n", "found unhashable key"),
])
def test_bad_recipe_is_named(fake, tmp_path, content, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(content if isinstance(content, bytes) else content.encode())
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello there.\n")
    result = _invoke("synth", manifest, "--out", tmp_path / "out", "--recipe", recipe)
    assert result.exit_code == 2
    assert message in result.stderr and str(recipe) in result.stderr


@pytest.mark.parametrize("key", RECIPE_KEYS)
def test_a_recipe_setting_given_as_null_is_left_at_its_default(tmp_path, key):
    recipe = tmp_path / "r.yaml"
    for null in ("null", "~", ""):
        recipe.write_text(f"{key}: {null}\n")
        assert load_recipe(str(recipe)) == {}


def test_a_recipe_may_merge_in_a_mapping_and_override_its_keys(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("<<: {seed: 1, greedy: true}\nseed: 2\n")
    assert load_recipe(str(recipe)) == {"seed": 2, "greedy": True}


def test_a_recipe_max_frames_null_runs_with_the_default_cap(fake, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("max_frames: null\nbatch_size: 1\n")
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello there.\nGood bye.\n")
    out = tmp_path / "out"
    result = _invoke("synth", manifest, "--out", out, "--model", tmp_path / "model", "--recipe", recipe)
    assert result.exit_code == 0, result.output
    assert fake.batches == [["000001"], ["000002"]]   # the recipe's other settings still apply
    assert json.loads((out / "report.json").read_text())["settings"]["max_frames"] is None


@pytest.mark.parametrize("value", ["9223372036854775808", "-9223372036854775809"])
def test_a_seed_beyond_64_bits_is_refused_before_the_run(fake, tmp_path, value):
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello there.\n")
    result = _invoke("synth", manifest, "--out", tmp_path / "out", "--seed", value)
    assert result.exit_code == 2 and "Invalid value for '--seed'" in result.output
    assert not (tmp_path / "out").exists()


def test_unknown_recipe_lists_the_known_names(fake, tmp_path):
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello there.\n")
    result = _invoke("synth", manifest, "--out", tmp_path / "out", "--recipe", "nope")
    assert result.exit_code == 2
    assert "recipe not found: nope" in result.stderr and "qwen3tts-1.7b-customvoice, tiny" in result.stderr


def test_verbose_logging_is_added_once_and_removed_without_it():
    import logging
    try:
        logs.log_to_stderr(True)
        logs.log_to_stderr(True)
        ours = [h for h in logging.getLogger("tts_cli").handlers if h is logs._handler]
        assert ours == [logs._handler] and logs.verbose()
    finally:
        logs.log_to_stderr(False)
    assert not logs.verbose()
    assert not any(h.formatter and h.formatter._fmt.endswith(": %(message)s")
                   for name in logs.LOGGERS for h in logging.getLogger(name).handlers)


@pytest.fixture
def cuda_seen(monkeypatch):
    """Makes torch report (or not) a CUDA device: cuda_seen(True)."""
    def see(available: bool):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: int(available))
    return see


@pytest.mark.parametrize("available, device, reason", [(True, "cuda", "auto: torch sees 1 CUDA device"),
                                                       (False, "cpu", "auto: torch sees no CUDA device")])
def test_synth_device_auto_picks_cuda_when_torch_sees_one_and_says_so(fake, tmp_path, cuda_seen,
                                                                        available, device, reason):
    cuda_seen(available)
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello there.\n")
    out = tmp_path / "out"
    result = _invoke("synth", manifest, "--out", out, "--model", tmp_path / "model")
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == f"device: {device} ({reason})"   # the first line of output
    assert fake.loaded_with["device"] == device
    report = json.loads((out / "report.json").read_text())
    assert report["device"] == device and report["settings"]["device_choice"] == reason
    assert f"- device / dtype: {device} ({reason}) / " in (out / "report.md").read_text()


def test_an_explicit_device_wins_over_auto_and_a_recipe_device_is_named(fake, tmp_path, cuda_seen):
    cuda_seen(True)
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello there.\n")
    result = _invoke("synth", manifest, "--out", tmp_path / "a", "--model", tmp_path / "model", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == "device: cpu (--device)" and fake.loaded_with["device"] == "cpu"
    recipe = tmp_path / "r.yaml"
    recipe.write_text("device: cpu\n")
    result = _invoke("synth", manifest, "--out", tmp_path / "b", "--model", tmp_path / "model", "--recipe", recipe)
    assert result.stderr.splitlines()[0] == f"device: cpu (recipe {recipe})" and fake.loaded_with["device"] == "cpu"
    assert json.loads((tmp_path / "b" / "report.json").read_text())["settings"]["device_choice"] == f"recipe {recipe}"


def test_gpus_replace_the_device_and_are_said(tmp_path, cuda_seen, monkeypatch):
    from tts_cli.scale import workers

    def no_workers(*args, **kwargs):
        raise TTSError("stopped before the workers start")

    cuda_seen(False)
    monkeypatch.setattr(workers, "WorkerPool", no_workers)
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello there.\n")
    checkpoint_with_empty_weights(tmp_path / "model")
    result = _invoke("synth", manifest, "--out", tmp_path / "out", "--model", tmp_path / "model", "--gpus", "cpu,cpu")
    assert result.stderr.splitlines()[0] == "device: cpu,cpu (--gpus: one worker per device)"
    assert "rows: auto" not in result.stderr   # CPU workers run lockstep batches, no engine slots


@pytest.mark.parametrize("available, dtype, line", [
    (True, "bfloat16", "device: cuda (auto: torch sees 1 CUDA device)"),
    (False, "bfloat16", "device: cpu (auto: torch sees no CUDA device)"),
    # float32's thresholds hold against the records on cpu only
    (True, "float32", "device: cpu (auto: --dtype float32 is checked on cpu, where its thresholds hold; "
                      "torch sees 1 CUDA device)"),
])
def test_verify_golden_device_auto(monkeypatch, cuda_seen, available, dtype, line):
    from tts_cli.quality import verify_golden
    ran_on = []
    monkeypatch.setattr(verify_golden, "verify", lambda model, golden, device, dtype: ran_on.append(device) or [])
    cuda_seen(available)
    result = _invoke("verify-golden", "--dtype", dtype)
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == line
    assert ran_on == [line.split()[1]]
    result = _invoke("verify-golden", "--dtype", dtype, "--device", "cpu")
    assert result.stderr.splitlines()[0] == "device: cpu (--device)" and ran_on[-1] == "cpu"


def test_bench_on_cpu_warns_that_the_cuda_engines_settings_given_are_ignored(monkeypatch, tmp_path):
    """As `tts synth` does: on cpu the vocoder and weights are fp32 and the code predictor runs its loop."""
    from test_bench_output import gpu_result

    from tts_cli import bench
    monkeypatch.setattr(bench, "run_bench", lambda *args, **options: gpu_result())
    result = _invoke("bench", "--device", "cpu", "--talker-precision", "bf16", "--codec-precision", "fp32",
                     "--json", tmp_path / "bench.json")
    assert result.exit_code == 0, result.output
    assert ("warning: --codec-precision fp32, --talker-precision bf16 ignored: they set the CUDA engine, and this "
            "run is on cpu") in " ".join(result.stderr.split())
    result = _invoke("bench", "--device", "cpu", "--json", tmp_path / "bench.json")
    assert "ignored" not in result.stderr


def test_bench_device_auto_on_cuda_runs_random_weights_at_the_cuda_levels(monkeypatch, cuda_seen, tmp_path):
    """(run_bench replaced: this machine may have no GPU.) Its result is printed and written."""
    from test_bench_output import gpu_result

    from tts_cli import bench
    asked = {}

    def fake_run_bench(spec, levels, sentences, requests, frames, device, **options):
        asked.update(spec=spec, levels=levels, requests=requests, device=device,
                     device_choice=options["device_choice"])
        result = gpu_result()
        options["on_row"](result)   # the JSON is written as the levels finish
        return result

    monkeypatch.setattr(bench, "run_bench", fake_run_bench)
    cuda_seen(True)
    out = tmp_path / "bench.json"
    result = _invoke("bench", "--json", out)
    assert result.exit_code == 0, result.output
    assert asked == dict(spec="random:1.7b", levels=[1, 64, 128, 256, 512], requests=None, device="cuda",
                         device_choice="auto: torch sees 1 CUDA device")
    assert result.stderr.splitlines()[0] == "device: cuda (auto: torch sees 1 CUDA device)"
    assert "CPU figures" not in result.output and json.loads(out.read_text())["rows"][2]["concurrency"] == 512


def test_bench_with_no_options_on_cpu_runs_the_bundled_model_and_says_cpu(monkeypatch, cuda_seen, tmp_path):
    cuda_seen(False)
    monkeypatch.chdir(tmp_path)   # bench.json lands in the current folder
    monkeypatch.setitem(cli.BENCH_LEVELS, "cpu", "2")   # the defaults' path, one small level: seconds
    result = _invoke("bench")
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == "device: cpu (auto: torch sees no CUDA device)"
    assert "CPU figures, not GPU figures" in result.stderr and ": CPU figures" in result.stdout
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["model"] == "bundled tiny-1.7b-customvoice" and report["device"] == "cpu"
    assert report["cpu_figures"] is True and report["note"].startswith("CPU figures, not GPU figures")
    assert report["device_choice"] == "auto: torch sees no CUDA device"
    assert [(r["concurrency"], r["requests"], r["bound_by"]) for r in report["rows"]] == [(2, 4, None)]
    assert report["rows"][0]["gpu_wait_ms_per_step"] == 0   # on CPU the work is done when queued
    # every field the JSON had before bound_by, device_choice, cpu_figures and note were added
    assert report.keys() >= {"model", "device", "dtype", "numerics", "gpu", "torch", "load_s", "sentences",
                             "sentence_count", "frames", "forced_length", "codec_window", "depth_setting",
                             "codec_stream_setting", "codec_precision", "talker_precision", "rows"}
    assert report["rows"][0].keys() >= {"concurrency", "requests", "frames", "audio_s", "wall_s", "audio_s_per_s",
                                        "xrt", "rtf", "first_audio_p50_s", "first_audio_p99_s", "ms_per_step",
                                        "steps", "slots_busy", "peak_gpu_gib", "depth", "codec_window",
                                        "codec_stream"}


def test_shared_options_take_their_defaults_from_one_settings_object():
    """synth's, bench's and verify-golden's options and the recipe keys all come from RunSettings:
    a default cannot differ between commands."""
    import dataclasses

    import typer.main

    from tts_cli import recipe
    commands = typer.main.get_command(cli.app).commands
    params = {name: {p.name: p for p in command.params} for name, command in commands.items()}
    fields = {field.name: field.default for field in dataclasses.fields(recipe.RunSettings)}
    assert recipe.RECIPE_KEYS.keys() == fields.keys()
    assert recipe.RECIPE_KEYS["max_frames"] is int and recipe.RECIPE_KEYS["model"] is str
    for name, default in fields.items():
        assert params["synth"][name].default == default, name
    for name in ("device", "depth", "codec_precision", "talker_precision"):
        assert params["bench"][name].default == params["synth"][name].default == fields[name], name
    assert params["verify-golden"]["device"].default == fields["device"] == "auto"


def test_bench_keeps_the_finished_levels_when_a_later_one_fails(monkeypatch, tmp_path):
    from tts_cli import bench
    monkeypatch.setattr(bench, "load_synthesizer", lambda spec, device, dtype, kind: None)
    monkeypatch.setattr(bench, "make_requests", lambda synth, sentences, count, frames, speaker, reference: [None] * count)

    def bench_one(synth, concurrency, requests, *args):
        if concurrency > 1:
            raise ValueError(f"no room for {concurrency} rows")
        return bench.BenchRow(concurrency, len(requests), 8, 0.64, 0.1, 6.4, 6.4, 0.16, 0.01, 0.01,
                              dict.fromkeys(cli.STEP_STAGES, 0.0), 9, 0.9, None, "loop", 16, False, None)

    monkeypatch.setattr(bench, "bench_one", bench_one)
    out = tmp_path / "bench.json"
    result = _invoke("bench", "--device", "cpu", "--concurrency", "1,2", "--json", out)
    assert result.exit_code == 2 and "no room for 2 rows" in result.stderr
    assert [(r["concurrency"], r["requests"]) for r in json.loads(out.read_text())["rows"]] == [(1, 2)]


def test_bench_out_of_gpu_memory_at_a_level_says_so_and_keeps_the_levels_before_it(monkeypatch, tmp_path):
    """An engine of more slots than the GPU holds (c2048 on an 80 GB H100, 2026-12-06) ended the bench with
    torch's traceback; now with one line naming the level and what the last one that fitted took."""
    from tts_cli import bench
    monkeypatch.setattr(bench, "load_synthesizer", lambda spec, device, dtype, kind: None)
    monkeypatch.setattr(bench, "make_requests", lambda synth, sentences, count, frames, speaker, reference: [None] * count)

    def bench_one(synth, concurrency, requests, *args):
        if concurrency > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 486.00 MiB.")
        return bench.BenchRow(concurrency, len(requests), 8, 0.64, 0.1, 6.4, 6.4, 0.16, 0.01, 0.01,
                              dict.fromkeys(cli.STEP_STAGES, 0.0), 9, 0.9, 31.1, "loop", 16, False, None)

    monkeypatch.setattr(bench, "bench_one", bench_one)
    out = tmp_path / "bench.json"
    result = _invoke("bench", "--device", "cpu", "--concurrency", "1,2", "--json", out)
    message = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert "c2: out of GPU memory" in message and "c1 peaked at 31.1 GiB" in message
    assert [r["concurrency"] for r in json.loads(out.read_text())["rows"]] == [1]


def test_bench_results_cut_short_by_a_failed_write_keep_the_levels_before_it(monkeypatch, tmp_path):
    """The results are rewritten after each concurrency: a write that fails (or is killed) halfway leaves the
    previous file whole."""
    from tts_cli import bench
    monkeypatch.setattr(bench, "load_synthesizer", lambda spec, device, dtype, kind: None)
    monkeypatch.setattr(bench, "make_requests", lambda synth, sentences, count, frames, speaker, reference: [None] * count)
    monkeypatch.setattr(bench, "bench_one", lambda synth, concurrency, requests, *args: bench.BenchRow(
        concurrency, len(requests), 8, 0.64, 0.1, 6.4, 6.4, 0.16, 0.01, 0.01, dict.fromkeys(cli.STEP_STAGES, 0.0),
        9, 0.9, None, "loop", 16, False, None))
    out = tmp_path / "bench.json"
    writes = []
    write_text = Path.write_text

    def half_then_disk_full(path, text, *args, **kwargs):
        if out.name not in path.name:
            return write_text(path, text, *args, **kwargs)
        writes.append(path)
        if len(writes) == 1:
            return write_text(path, text, *args, **kwargs)
        write_text(path, text[:len(text) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_disk_full)
    result = _invoke("bench", "--device", "cpu", "--concurrency", "1,2", "--json", out)
    assert result.exit_code == 2 and f"cannot write the results {out}" in " ".join(result.stderr.split())
    assert [r["concurrency"] for r in json.loads(out.read_text())["rows"]] == [1]
    assert [p.name for p in tmp_path.iterdir()] == [out.name]   # no temporary file left
