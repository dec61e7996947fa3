"""report.html from `tts synth` and `tts score`: every row listed, flagged and worst-WER rows first,
players that load their audio (wav files, or parquet rows extracted beside the page), text escaped,
sortable columns.

The runs use the fake synthesizer and a fake ASR (hypotheses chosen per text), so they take well under
a second. The browser test drives Debian's chromium through Playwright (`make test` installs both) and
skips with the reason where either is missing.
"""
import html
import io
import json
import shutil
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pyarrow.parquet as pq
import pytest
import soundfile as sf
from typer.testing import CliRunner

from tts_cli import cli
from tts_cli.output import report_html

from fakes import SAMPLES_PER_FRAME, use_fake_synthesizer

runner = CliRunner()
SCRIPT_TEXT = '<script>window.pwned = 1</script> <img src=x onerror="window.pwned = 2"> It\'s easy to tell.'
# id, text, what the fake ASR hears (None: the text itself). "short" is slow (its fake audio is long
# for its three characters); "script" is above 50% WER; "bad" fails its synthesis.
ROWS = [
    ("plain", "The birch canoe slid on the smooth planks.", None),
    ("partial", "Glue the sheet to the dark blue background.", "glue the sheet to the dark"),
    ("script", SCRIPT_TEXT, "it's easy"),
    ("short", "Hi.", "hi"),
    ("bad", "boom goes the row.", None),
]
FIRST_ORDER = ["script", "short", "bad", "partial", "plain"]   # flagged by WER, then failed; then by WER
HEARD = {text: heard for _, text, heard in ROWS}


class FakeAsrPool:
    """AsrPool's interface in process: the audio's real length and level, the hypothesis from HEARD."""

    def __init__(self, model_path, workers=1, start_now=False):
        self.heard = {}

    def submit(self, key, audio, text, language):
        from tts_cli.quality.asr import Transcript
        if isinstance(audio, tuple):
            samples, rate = audio[:2]   # (samples, rate, container)
        else:
            samples, rate = sf.read(io.BytesIO(audio) if isinstance(audio, bytes) else audio, dtype="float32")
        rms = float(np.sqrt(np.mean(np.square(samples)))) if len(samples) else 0.0
        self.heard[key] = Transcript(len(samples) / rate, rms, HEARD[text] or text, "en")

    def results(self):
        return self.heard

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _manifest(tmp_path) -> Path:
    manifest = tmp_path / "m.txt"
    manifest.write_text("".join(f"{row_id}\t{text}\n" for row_id, text, _ in ROWS), encoding="utf-8")
    return manifest


@pytest.fixture
def with_fake_asr(monkeypatch, tmp_path):
    pytest.importorskip("jiwer", reason="the extra [wer] is not installed (WER needs jiwer)")
    from tts_cli.quality import asr, scoring, synth_wer
    use_fake_synthesizer(monkeypatch, tmp_path)
    choice = asr.AsrModelChoice(tmp_path, "a fake ASR (tests/test_report_html.py)")
    monkeypatch.setattr(cli, "resolve_synth_asr", lambda option, required=False: choice)
    monkeypatch.setattr(asr, "resolve_asr_model", lambda option: choice)
    monkeypatch.setattr(synth_wer, "AsrPool", FakeAsrPool)
    monkeypatch.setattr(scoring, "AsrPool", FakeAsrPool)


def _synth(tmp_path, out, *options):
    result = runner.invoke(cli.app, ["synth", str(_manifest(tmp_path)), "--out", str(out),
                                     "--model", str(tmp_path / "model"), "--asr-workers", "1", *map(str, options)])
    assert result.exit_code == 1, result.output   # the "bad" row fails
    return json.loads((out / "report.json").read_text())


class PageParser(HTMLParser):
    """The rows table's header keys and rows (attributes, cell text by class, audio src), and every
    script element and URL attribute of the page."""

    def __init__(self, page: str):
        super().__init__()
        self.columns, self.rows, self.scripts, self.urls = [], [], 0, []
        self._in_body, self._cell = False, None
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.urls += [attrs[name] for name in ("src", "href") if name in attrs]
        if tag == "script":
            self.scripts += 1
        elif tag == "tbody":
            self._in_body = True
        elif tag == "th" and "data-type" in attrs or tag == "th" and attrs.get("class") == "listen":
            self.columns.append(attrs["class"])
        elif tag == "tr" and self._in_body:
            self.rows.append({"attrs": attrs, "cells": {}, "audio": None})
        elif tag == "td" and self._in_body:
            self._cell = attrs["class"]
            self.rows[-1]["cells"][self._cell] = ""
        elif tag == "audio" and self._in_body:
            self.rows[-1]["audio"] = attrs

    def handle_endtag(self, tag):
        if tag == "tbody":
            self._in_body = False
        elif tag == "td":
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self.rows[-1]["cells"][self._cell] += data


def test_synth_page_lists_every_row_flagged_first_with_players_and_escaped_text(with_fake_asr, tmp_path):
    out = tmp_path / "out"
    report = _synth(tmp_path, out)
    wer_rows = {r["id"]: r for r in pq.read_table(out / "rows.parquet").to_pylist()}
    page_text = (out / "report.html").read_text(encoding="utf-8")
    page = PageParser(page_text)

    assert [r["attrs"]["data-id"] for r in page.rows] == FIRST_ORDER
    assert [r["attrs"]["data-flagged"] for r in page.rows] == ["1", "1", "1", "0", "0"]
    assert page.columns == ["row", "id", "flags", "wer", "frames", "audio", "wall", "listen", "text", "hypothesis"]
    by_id = {r["attrs"]["data-id"]: r for r in page.rows}
    report_rows = {r["id"]: r for r in report["rows"]}
    for row_id, row in by_id.items():
        cells, expected = row["cells"], report_rows[row_id]
        assert cells["text"] == expected["text"] and cells["row"] == str(expected["row"])
        assert cells["flags"].split() == wer_rows[row_id]["flags"] + (["failed"] if expected["error"] else [])
        if expected["error"] is None:
            assert row["audio"]["src"] == expected["file"] and (out / row["audio"]["src"]).is_file()
            assert row["audio"]["preload"] == "metadata"
            assert cells["hypothesis"] == wer_rows[row_id]["hypothesis"]
            assert cells["wer"] == f"{100 * wer_rows[row_id]['wer']:.1f}%"
        else:
            assert row["audio"] is None and cells["listen"] == expected["error"] and "boom" in expected["error"]
    assert by_id["short"]["cells"]["flags"] == "slow" and by_id["script"]["cells"]["flags"] == "wer_above_50"

    # Row text is data, never markup: one script element (the page's), and no URL but the audio files'.
    assert page.scripts == 1 and "<script>window.pwned" not in page_text and "&lt;script&gt;window.pwned" in page_text
    assert sorted(page.urls) == sorted(r["file"] for r in report["rows"] if r["file"])
    summary = report["wer"]["summary"]
    assert f"<td>{summary['scored_rows']}</td>" in page_text and f"{100 * summary['mean_wer']:.1f}%" in page_text
    assert html.escape(f"{report['device']} / {report['dtype']}") in page_text and '<svg class="timing"' in page_text


def test_parquet_rows_audio_is_extracted_beside_the_page(monkeypatch, tmp_path):
    """Without WER (as --no-wer): no WER columns; rows at the frame cap flagged. A file in report_audio/
    that no row names is removed by the next run; beyond PRELOAD_METADATA_MAX_PLAYERS players no preload."""
    use_fake_synthesizer(monkeypatch, tmp_path)
    out = tmp_path / "out"
    _synth(tmp_path, out, "--format", "parquet", "--max-frames", 3)
    (out / report_html.PARQUET_AUDIO_FOLDER / "gone.flac").write_bytes(b"an earlier run's row")
    report = _synth(tmp_path, out, "--format", "parquet", "--max-frames", 3)
    shard_audio = {row["id"]: row["audio"] for row in pq.read_table(out / "part-00000.parquet").to_pylist()}
    page = PageParser((out / "report.html").read_text(encoding="utf-8"))

    assert "wer" not in page.columns and "hypothesis" not in page.columns
    capped = {r["id"] for r in report["rows"] if r["hit_cap"]}
    assert capped and {r["attrs"]["data-id"] for r in page.rows if r["cells"]["flags"] == "hit_cap"} == capped
    sources = {r["attrs"]["data-id"]: r["audio"]["src"] for r in page.rows if r["audio"]}
    assert set(sources) == set(shard_audio) == {r["id"] for r in report["rows"] if r["error"] is None}
    frames = {r["id"]: r["frames"] for r in report["rows"]}
    for row_id, src in sources.items():
        assert src == f"report_audio/{shard_audio[row_id]['path']}"
        assert (out / src).read_bytes() == shard_audio[row_id]["bytes"]
        assert sf.info(out / src).frames == frames[row_id] * SAMPLES_PER_FRAME
    assert sorted(p.name for p in (out / "report_audio").iterdir()) == sorted(Path(s).name for s in sources.values())

    monkeypatch.setattr(report_html, "PRELOAD_METADATA_MAX_PLAYERS", len(sources) - 1)
    report_html.write_synth_html(out, report)
    assert {r["audio"]["preload"] for r in PageParser((out / "report.html").read_text()).rows if r["audio"]} == {"none"}


def test_the_audio_copies_of_a_parquet_run_go_when_the_folder_is_redone_in_another_format(monkeypatch, tmp_path):
    """report_audio/ holds copies of the parquet rows' audio for the page; once the rows are made again as
    files (--redo-changed --format wav), no page links them: they are removed, not left beside the files."""
    use_fake_synthesizer(monkeypatch, tmp_path)
    manifest, out = tmp_path / "m.txt", tmp_path / "out"
    manifest.write_text("a\tThe first row.\nb\tThe second row.\n")
    options = ["--out", str(out), "--model", str(tmp_path / "model"), "--no-wer"]
    assert runner.invoke(cli.app, ["synth", str(manifest), *options, "--format", "parquet"]).exit_code == 0
    assert len(list((out / report_html.PARQUET_AUDIO_FOLDER).iterdir())) == 2
    result = runner.invoke(cli.app, ["synth", str(manifest), *options, "--format", "wav", "--redo-changed"])
    assert result.exit_code == 0, result.output
    assert list((out / report_html.PARQUET_AUDIO_FOLDER).iterdir()) == []
    sources = [r["audio"]["src"] for r in PageParser((out / "report.html").read_text(encoding="utf-8")).rows]
    assert sorted(sources) == ["a.wav", "b.wav"]


def test_parquet_rows_of_two_runs_with_one_name_get_their_own_audio(monkeypatch, tmp_path):
    """Names are unique within a run: a row added by a later run can have the name an earlier run's row
    has in its shard ('a!' and 'a?' are both a_.flac); each row's player still plays its own audio."""
    use_fake_synthesizer(monkeypatch, tmp_path)
    manifest, out = tmp_path / "m.txt", tmp_path / "out"
    options = ["--out", str(out), "--model", str(tmp_path / "model"), "--format", "parquet", "--greedy", "--no-wer"]
    manifest.write_text("a?\tThe first row.\n")
    assert runner.invoke(cli.app, ["synth", str(manifest), *options]).exit_code == 0
    manifest.write_text("a!\tA second row, longer than the first.\na?\tThe first row.\n")
    result = runner.invoke(cli.app, ["synth", str(manifest), *options])
    assert result.exit_code == 0, result.output
    shard_audio = {row["id"]: row["audio"]["bytes"] for shard in sorted(out.glob("part-*.parquet"))
                   for row in pq.read_table(shard).to_pylist()}
    sources = {r["attrs"]["data-id"]: r["audio"]["src"]
               for r in PageParser((out / "report.html").read_text(encoding="utf-8")).rows}
    assert len(set(sources.values())) == 2
    for row_id, src in sources.items():
        assert (out / src).read_bytes() == shard_audio[row_id]


def test_a_report_audio_folder_that_cannot_be_made_stops_the_run_with_status_2(monkeypatch, tmp_path):
    """As for any output that cannot be written: one line naming the path, exit 2 (it was a traceback, 1)."""
    use_fake_synthesizer(monkeypatch, tmp_path)
    manifest, out = tmp_path / "m.txt", tmp_path / "out"
    manifest.write_text("a\tThe first row.\n")
    assert runner.invoke(cli.app, ["synth", str(manifest), "--out", str(out), "--model", str(tmp_path / "model"),
                                   "--format", "parquet", "--no-wer"]).exit_code == 0
    shutil.rmtree(out / report_html.PARQUET_AUDIO_FOLDER)
    (out / report_html.PARQUET_AUDIO_FOLDER).write_text("in the way")
    result = runner.invoke(cli.app, ["synth", str(manifest), "--out", str(out), "--model", str(tmp_path / "model"),
                                     "--format", "parquet", "--no-wer"])
    assert result.exit_code == 2, result.output
    assert f"cannot write {out / report_html.PARQUET_AUDIO_FOLDER}: File exists" in result.stderr


def test_score_page_links_the_files_in_the_audio_folder(with_fake_asr, tmp_path):
    audio_dir, out = tmp_path / "audio", tmp_path / "scores"
    audio_dir.mkdir()
    for row_id, _, _ in ROWS[:4]:   # "bad" has no file
        sf.write(audio_dir / f"{row_id}.flac", 0.3 * np.sin(np.arange(4800) / 10), 24000)
    result = runner.invoke(cli.app, ["score", str(audio_dir), "--manifest", str(_manifest(tmp_path)),
                                     "--out", str(out), "--asr-workers", "1"])
    assert result.exit_code == 1, result.output
    page = PageParser((out / "report.html").read_text(encoding="utf-8"))
    assert [r["attrs"]["data-id"] for r in page.rows] == FIRST_ORDER
    for row in page.rows:
        row_id = row["attrs"]["data-id"]
        if row_id == "bad":
            assert row["audio"] is None and "audio file not found" in row["cells"]["listen"]
        else:
            assert row["audio"]["src"] == f"../audio/{row_id}.flac"
            assert (out / unquote(row["audio"]["src"])).resolve() == (audio_dir / f"{row_id}.flac").resolve()


def test_score_numbers_each_row_by_its_manifest_line_as_synth_does(with_fake_asr, tmp_path):
    """A blank line of a .txt manifest is skipped but counted (tts synth names an id-less row by its line):
    tts score gives each row the line number tts synth's reports give it, not its place among the rows read."""
    manifest, out, scores = tmp_path / "m.txt", tmp_path / "out", tmp_path / "scores"
    manifest.write_text(f"{ROWS[0][1]}\n\n{ROWS[1][1]}\n", encoding="utf-8")
    result = runner.invoke(cli.app, ["synth", str(manifest), "--out", str(out), "--model", str(tmp_path / "model"),
                                     "--asr-workers", "1"])
    assert result.exit_code == 0, result.output
    lines = {r["id"]: r["row"] for r in json.loads((out / "report.json").read_text())["rows"]}
    assert lines == {"000001": 1, "000003": 3}
    result = runner.invoke(cli.app, ["score", str(out), "--manifest", str(manifest), "--out", str(scores),
                                     "--asr-workers", "1"])
    assert result.exit_code == 0, result.output
    for folder in (out, scores):
        page = PageParser((folder / "report.html").read_text(encoding="utf-8"))
        assert {r["attrs"]["data-id"]: int(r["cells"]["row"]) for r in page.rows} == lines, folder
    assert {r["id"]: r["row"] for r in json.loads((scores / "report.json").read_text())["rows"]} == lines
    for folder in (out, scores):
        assert {r["id"]: r["row"] for r in pq.read_table(folder / "rows.parquet").to_pylist()} == lines


def test_a_row_heard_but_not_scored_shows_why_beside_its_hypothesis():
    """A row the ASR heard whose text has nothing to score (report.md gives the reason): the page shows
    the hypothesis and the reason, not a hypothesis beside a blank WER."""
    row = report_html.PageRow(1, "marks", "... !!! ???", audio="marks.wav", hypothesis="uh",
                              not_scored="its text has no words to score")
    columns = [report_html.Column("wer", "WER", "number"), report_html.Column("hypothesis", "heard", None)]
    cells = report_html._table_row(0, row, columns, {}, "none")
    assert '<td class="wer" data-sort=""></td>' in cells
    assert 'uh<br><span class="note">not scored: its text has no words to score</span>' in cells


# The browser test ----------------------------------------------------------------------------------

def _chromium() -> str:
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright; "
                                                      "make test installs it with the extra [test])")
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.skip("no chromium on PATH (Debian: apt-get install chromium; make test installs it as root)")


@pytest.fixture(scope="module")
def browser():
    executable = _chromium()
    from playwright.sync_api import sync_playwright
    with sync_playwright() as playwright:
        # --no-sandbox: chromium's sandbox refuses to run as root (CI containers).
        chromium = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        yield chromium
        chromium.close()


# Each player's duration once its metadata is in (NaN with the error code when it could not load).
AUDIO_DURATIONS = """audios => Promise.all(audios.map(audio => new Promise(done => {
  const report = () => done(audio.error ? "error " + audio.error.code : audio.duration);
  if (audio.readyState >= 1 || audio.error) return report();
  audio.addEventListener("loadedmetadata", report);
  audio.addEventListener("error", report);
})))"""
ROW_IDS = "rows => rows.map(row => row.dataset.id)"


@pytest.mark.parametrize("output_format", ["wav", "parquet"])
def test_report_page_in_a_browser(browser, with_fake_asr, tmp_path, output_format):
    out = tmp_path / "out"
    report = _synth(tmp_path, out, "--format", output_format)
    page = browser.new_page()
    try:
        page.goto((out / "report.html").as_uri())
        rows = "table.rows tbody tr"
        assert page.eval_on_selector_all(rows, ROW_IDS) == FIRST_ORDER   # every row; flagged first
        assert page.eval_on_selector_all(rows, "rows => rows.map(row => row.dataset.flagged)") == list("11100")
        assert page.evaluate("window.pwned") is None
        assert page.inner_text("tr[data-id=script] td.text") == SCRIPT_TEXT

        expected = {r["id"]: r["audio_seconds"] for r in report["rows"] if r["error"] is None}
        players = page.eval_on_selector_all(f"{rows} audio", "audios => audios.map(a => a.closest('tr').dataset.id)")
        durations = dict(zip(players, page.eval_on_selector_all(f"{rows} audio", AUDIO_DURATIONS)))
        assert durations.keys() == expected.keys()
        for row_id, seconds in expected.items():
            assert durations[row_id] == pytest.approx(seconds, abs=0.01), (row_id, durations[row_id])

        page.click("th.wer")   # ascending; ties keep the first order; rows without a WER last
        assert page.eval_on_selector_all(rows, ROW_IDS) == ["short", "plain", "partial", "script", "bad"]
        page.click("th.wer")
        assert page.eval_on_selector_all(rows, ROW_IDS) == ["script", "partial", "short", "plain", "bad"]
        page.click("th.row")
        assert page.eval_on_selector_all(rows, ROW_IDS) == [row_id for row_id, _, _ in ROWS]
        page.click("th.flags")
        assert page.eval_on_selector_all(rows, ROW_IDS) == FIRST_ORDER
    finally:
        page.close()
