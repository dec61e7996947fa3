"""`tts` end to end: with a fake synthesizer for the CLI's own logic, and with the bundled tiny model."""
import importlib.util
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf
import torch
from typer.testing import CliRunner

from tts_cli import __version__, cli, logs
from tts_cli.errors import CheckpointError

from fakes import SAMPLES_PER_FRAME, use_fake_synthesizer

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
    assert totals["ok"] + totals["failed"] == totals["rows"] == len(report["rows"])
    assert totals["audio_seconds"] == pytest.approx(sum(r["audio_seconds"] or 0 for r in report["rows"]), abs=1e-2)
    assert totals["xrt"] == totals["audio_seconds_per_second"]
    assert f"| {totals['ok']} | {totals['failed']} | {totals['skipped_empty']} |" in markdown
    assert "xRT = audio_seconds_this_run / wall_seconds" in markdown


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

    def spy(requests, greedy=False, max_frames=None, max_rows=None):
        seen.update(greedy=greedy, max_frames=max_frames, seeds=[r.seed for r in requests])
        return synthesize(requests, greedy=greedy, max_frames=max_frames, max_rows=max_rows)

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
    assert result.stderr.strip() == f"error: {message}"


def test_missing_model_dir_names_the_path(fake, tmp_path):
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello.\n")
    result = _invoke("synth", manifest, "--out", tmp_path / "out", "--model", tmp_path / "no-such-model")
    _assert_one_red_line(result, f"model directory not found: {tmp_path / 'no-such-model'} (from --model)")


def test_missing_tts_model_dir_names_the_path_and_the_variable(fake, tmp_path):
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello.\n")
    result = _invoke("synth", manifest, "--out", tmp_path / "out", env={"TTS_MODEL": str(tmp_path / "gone")})
    _assert_one_red_line(result, f"model directory not found: {tmp_path / 'gone'} (from $TTS_MODEL)")


def test_on_cuda_calls_carry_sixteen_times_the_engine_rows(fake, tmp_path, monkeypatch):
    # (the device check is skipped: this machine may have no GPU; the fake synthesizer needs none)
    monkeypatch.setattr(cli, "check_device", lambda device: None)
    manifest = tmp_path / "m.txt"
    manifest.write_text("".join(f"Sentence {i}.\n" for i in range(50)))
    result = _invoke("synth", manifest, "--out", tmp_path / "out", "--model", tmp_path / "model",
                     "--device", "cuda", "--rows", 3, "--codec-precision", "fp32", "--talker-precision", "bf16")
    assert result.exit_code == 0, result.output
    assert fake.loaded_with == {"device": "cuda", "engine_rows": 3, "depth": "auto", "codec_precision": "fp32",
                                "talker_precision": "bf16"}
    assert [len(batch) for batch in fake.batches] == [48, 2] and fake.max_rows == [48, 48]
    result = _invoke("synth", manifest, "--out", tmp_path / "out-cpu", "--model", tmp_path / "model", "--rows", 3)
    assert [len(batch) for batch in fake.batches[2:]] == [8] * 6 + [2]   # cpu: 8 per call, whatever --rows


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
    (tmp_path / "model").mkdir()
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
    (tmp_path / "model").mkdir()
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello.\n")
    result = _invoke("synth", manifest, "--out", tmp_path / "out", "--model", tmp_path / "model")
    _assert_one_red_line(result, f"{tmp_path / 'model' / 'config.json'}: not valid JSON")


@pytest.mark.parametrize("device, message", [
    ("toaster", "--device 'toaster': Expected one of"),
    pytest.param("cuda", "--device 'cuda': torch reports no CUDA device on this machine",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
])
def test_unusable_device_is_one_red_line(fake, tmp_path, device, message):
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
    assert report["sentences"] == "bundled harvard-sentences.txt" and report["sentence_count"] == 360
    assert "audio-s/s" in result.stdout and "slot-steps that made a frame: " in result.stdout


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


def test_bench_rejects_bad_options():
    result = _invoke("bench", "--device", "cpu", "--concurrency", "1,x")
    assert result.exit_code == 2 and "--concurrency takes integers" in result.stderr
    result = _invoke("bench", "--device", "cpu", "--model", "random:7b")
    assert result.exit_code == 2 and "unknown random model 'random:7b'" in result.stderr


def test_version_and_help():
    assert _invoke("--version").stdout.strip() == f"tts {__version__}"
    help_text = _invoke("synth", "--help").output
    assert "1 some rows failed" in help_text and "--max-frames" in help_text


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
    assert "tts: synthesis path: plain model (cpu)" in result.stderr   # --verbose: the path taken
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
    ("batch_size: many\n", "'batch_size' should be int"),
    ("[1, 2]\n", "expected a mapping"),
])
def test_bad_recipe_is_named(fake, tmp_path, content, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(content)
    manifest = tmp_path / "m.txt"
    manifest.write_text("Hello there.\n")
    result = _invoke("synth", manifest, "--out", tmp_path / "out", "--recipe", recipe)
    assert result.exit_code == 2
    assert message in result.stderr and str(recipe) in result.stderr


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
