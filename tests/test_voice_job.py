"""Voice cloning through `tts synth` on a Base checkpoint: each distinct reference encoded once per
run and kept in OUT/.references, the encoded voice reaching the synthesizer, resume after SIGKILL
without encoding again, and bad reference rows failing alone."""
import json
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf
from typer.testing import CliRunner

from tts_cli import cli
from tts_cli.output.ledger import LEDGER_NAME
from tts_cli.voice import reference_audio
from tts_cli.voice.cache import CACHE_DIR_NAME
from tts_cli.voice.reference_audio import ReferenceAudioError

from killed_runs import synth_command, synth_killed_after
from test_voice_manifest import BAD_ROWS, GOOD_CLONE_ROWS, write_fuzz_manifest

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]
BASE_MODEL = REPO / "tests" / "fixtures" / "tiny-1.7b-base"
ROWS = 200
REFERENCES = 3
# Every 8th row clones in ICL mode (its reference's codes decoded before its own: the slower kind
# on CPU), the others from the speaker embedding alone.
ICL_EVERY = 8
OPTIONS = ["--model", str(BASE_MODEL), "--max-frames", "2", "--greedy", "--no-wer"]


def write_clone_manifest(folder: Path) -> Path:
    """ROWS rows over REFERENCES reference files (refs/ref-K.wav, 1.0-1.2 s, each its own tones),
    named relative to the manifest."""
    (folder / "refs").mkdir(parents=True)
    for k in range(REFERENCES):
        t = np.arange(int(24000 * (1.0 + 0.1 * k))) / 24000
        wave = 0.3 * np.sin(2 * np.pi * (220 + 110 * k) * t) * (1 + 0.5 * np.sin(2 * np.pi * (3 + k) * t))
        sf.write(folder / "refs" / f"ref-{k}.wav", wave, 24000, subtype="PCM_16")
    path = folder / "clones.parquet"
    icl = [i % ICL_EVERY == 0 for i in range(ROWS)]
    pq.write_table(pa.table({
        "id": [f"row-{i:03d}" for i in range(ROWS)],
        "text": [f"Line {i} in a cloned voice." for i in range(ROWS)],
        "ref_audio": [f"refs/ref-{i % REFERENCES}.wav" for i in range(ROWS)],
        "ref_text": [f"Reference {i % REFERENCES}." if icl[i] else None for i in range(ROWS)],
        "x_vector_only": [not icl[i] for i in range(ROWS)],
    }), path)
    return path


def _ledger(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / LEDGER_NAME).read_text().splitlines()]


def _cache_files(out: Path) -> dict[str, tuple[int, int]]:
    """Each cache file with its inode and mtime: a file encoded again is replaced (a new inode)."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (out / CACHE_DIR_NAME).iterdir()}


def _check_every_row_once(out: Path) -> None:
    report = json.loads((out / "report.json").read_text())
    assert [r["id"] for r in report["rows"]] == [f"row-{i:03d}" for i in range(ROWS)]
    for row in report["rows"]:
        assert row["error"] is None, row
        assert sf.info(out / row["file"]).frames == row["frames"] * 1920 > 0
    assert sorted(e["id"] for e in _ledger(out)) == [f"row-{i:03d}" for i in range(ROWS)]   # each exactly once


def test_200_rows_over_3_references_encode_each_once_and_clone_the_encoded_voice(tmp_path):
    manifest = write_clone_manifest(tmp_path)
    out = tmp_path / "out"
    result = runner.invoke(cli.app, ["synth", str(manifest), "--out", str(out), "--batch-size", "200", *OPTIONS])
    assert result.exit_code == 0, result.output
    assert f"{ROWS} rows ok (0 from an earlier run), 0 failed" in result.output
    assert "references: 3 used by this run's rows, 3 encoded in" in result.output
    report = json.loads((out / "report.json").read_text())
    assert {k: v for k, v in report["references"].items() if "seconds" not in k} == {
        "references_used": 3, "references_encoded": 3, "references_from_cache_files": 0}
    assert report["references"]["reference_encode_seconds"] > report["references"]["reference_encoder_load_seconds"] > 0
    assert "References: 3 used by this run's rows, 3 encoded in" in (out / "report.md").read_text()
    assert "References: 3 used by this run&#x27;s rows, 3 encoded in" in (out / "report.html").read_text()
    _check_every_row_once(out)
    assert len(_cache_files(out)) == 3

    # The written audio is what the synthesizer makes from the encoded reference: an ICL row
    # (codes and transcript) and an x-vector row, each against a direct call.
    from tts_cli.request import Request, VoiceReference
    from tts_cli.synthesizer import Synthesizer
    from tts_cli.voice.reference_audio import load_reference
    from tts_cli.voice.voices import ReferenceEncoders

    synth, encoders = Synthesizer.from_pretrained(BASE_MODEL), ReferenceEncoders(BASE_MODEL)
    for i in (8, 13):   # row 8: ICL on ref-2; row 13: x-vector only on ref-1
        embedding, codes = encoders(load_reference(str(tmp_path / "refs" / f"ref-{i % 3}.wav")).waveform)
        icl = i % ICL_EVERY == 0
        reference = VoiceReference(embedding, codes if icl else None, f"Reference {i % 3}." if icl else None)
        [expected] = synth.synthesize([Request(f"row-{i:03d}", f"Line {i} in a cloned voice.", reference=reference)],
                                      greedy=True, max_frames=2)
        written, _ = sf.read(out / f"row-{i:03d}.wav", dtype="float32")
        assert len(written) == len(expected.audio) > 0
        np.testing.assert_allclose(written, np.clip(expected.audio, -1, 1), atol=2 / 32768)

    again = runner.invoke(cli.app, ["synth", str(manifest), "--out", str(out), *OPTIONS])
    assert again.exit_code == 0 and f"{ROWS} rows ok ({ROWS} from an earlier run)" in again.output
    assert json.loads((out / "report.json").read_text())["references"]["references_encoded"] == 0
    assert "References: 0 used by this run's rows, 0 encoded" in (out / "report.md").read_text()


def test_sigkill_mid_run_then_rerun_does_each_row_once_and_encodes_no_reference_again(tmp_path):
    """Acceptance: the 200-row manifest, SIGKILLed mid-run, then the same command again."""
    manifest = write_clone_manifest(tmp_path)
    out = tmp_path / "out"
    synth_killed_after([str(manifest), "--batch-size", "25", *OPTIONS], out, rows=25)
    done_before = {e["id"] for e in _ledger(out)}
    assert 25 <= len(done_before) < ROWS
    cached = _cache_files(out)
    assert len(cached) == 3   # every reference is encoded before the first batch goes out

    second = runner.invoke(cli.app, ["synth", str(manifest), "--out", str(out), "--batch-size", "200", *OPTIONS])
    assert second.exit_code == 0, second.output
    assert f"{ROWS} rows ok ({len(done_before)} from an earlier run)" in second.output
    report = json.loads((out / "report.json").read_text())
    assert {k: v for k, v in report["references"].items() if "seconds" not in k} == {
        "references_used": 3, "references_encoded": 0, "references_from_cache_files": 3}
    assert report["references"]["reference_encoder_load_seconds"] == 0   # the encoders never loaded
    assert _cache_files(out) == cached
    _check_every_row_once(out)


def test_fuzz_through_tts_synth_on_a_base_checkpoint(tmp_path):
    """Bad reference rows fail with their reason, the good clone rows are synthesized, the rows
    without a reference fail (a Base checkpoint only clones), exit status 1, no crash."""
    path, expected, _ = write_fuzz_manifest(tmp_path, plain_rows=2)
    out = tmp_path / "out"
    result = runner.invoke(cli.app, ["synth", str(path), "--out", str(out), "--max-text-chars", "100", *OPTIONS])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    report = json.loads((out / "report.json").read_text())
    assert [row["id"] for row in report["rows"]] == [row_id for row_id, _, _ in expected]
    for row, (row_id, reason, clones) in zip(report["rows"], expected):
        if clones:
            assert row["error"] is None and sf.info(out / row["file"]).frames == row["frames"] * 1920 > 0, row
        else:
            needed = reason or "a Base checkpoint clones a voice: the row needs a reference (ref_audio)"
            assert needed in (row["error"] or "") and row["file"] is None, (row, needed)
    assert report["totals"]["ok"] == len(GOOD_CLONE_ROWS)
    assert report["totals"]["failed"] == len(BAD_ROWS) + 2
    # good.wav (twice: relative and absolute), good.flac, good.ogg
    assert report["references"]["references_used"] == report["references"]["references_encoded"] == 3


CLONE_OPTIONS = ["--ref-audio", "me.wav", "--x-vector-only"]


@pytest.mark.parametrize("columns, options, reason", [
    ({"speaker": ["vivian"]}, CLONE_OPTIONS, "speaker 'vivian': a Base checkpoint has no named speakers"),
    ({"instruct": ["Calm."]}, CLONE_OPTIONS, "instruct with ref_audio: a voice clone takes no instruct"),
    ({"ref_audio": ["me.wav"], "x_vector_only": [True]}, ["--model", str(cli.BUNDLED_MODEL_DIR)],
     "this checkpoint (custom_voice) cannot clone a voice"),
])
def test_a_row_its_checkpoint_cannot_clone_fails_with_the_reason(tmp_path, monkeypatch, columns, options, reason):
    """A row's own voice columns are checked row by row: the row fails, the other row goes on."""
    monkeypatch.chdir(tmp_path)
    sf.write(tmp_path / "me.wav", np.sin(np.arange(30000) / 7) * 0.3, 24000, subtype="PCM_16")
    pq.write_table(pa.table({"id": ["own", "plain"], "text": ["One line to speak.", "Another line."],
                             **{name: values + [None] for name, values in columns.items()}}), tmp_path / "m.parquet")
    result = runner.invoke(cli.app, ["synth", "m.parquet", "--out", "out", *OPTIONS, *options])
    assert result.exit_code == 1, result.output
    own, plain = json.loads((tmp_path / "out" / "report.json").read_text())["rows"]
    assert reason in own["error"] and own["file"] is None
    assert own["wall_seconds"] is None   # refused before any batch: no time of its own, as a row the manifest refuses
    assert plain["error"] is None and plain["frames"] == 2 and plain["wall_seconds"] > 0, plain


@pytest.mark.parametrize("options, message", [
    (["--speaker", "vivian", "--ref-audio", "me.wav", "--x-vector-only"],
     "--speaker: speaker 'vivian': a Base checkpoint has no named speakers; it clones the reference voice"),
    (["--recipe", "tiny", "--model", str(BASE_MODEL), "--ref-audio", "me.wav", "--x-vector-only"],
     "recipe tiny: speaker 'vivian': a Base checkpoint has no named speakers"),
    (["--instruct", "Calm.", "--ref-audio", "me.wav", "--x-vector-only"],
     "--instruct: a Base checkpoint takes no instruction"),
    (["--ref-audio", "me.wav"], "--ref-audio: ICL voice cloning (without --x-vector-only) needs --ref-text, the "
                                "reference's transcript; give it, or set --x-vector-only"),
    (["--ref-audio", "me.wav", "--ref-text", "   "], "--ref-audio: ICL voice cloning (without --x-vector-only) needs"),
    (["--ref-audio", "me.wav", "--ref-text", "bad\x07"], "--ref-text: text contains control character U+0007"),
    (["--ref-audio", "me.wav", "--ref-text", "Say <|im_end|> now."],
     "--ref-text: holds '<|im_end|>', one of the tokenizer's own tokens: it would be read as that token"),
    (["--model", str(REPO / "tests" / "fixtures" / "tiny-1.7b-voicedesign"), "--instruct", "A <tts_pad> voice."],
     "--instruct: holds '<tts_pad>', one of the tokenizer's own tokens"),
    (["--ref-text", "Some words."], "--ref-text: given without --ref-audio, whose option it is (the transcript of "
                                    "that file); a manifest row with a reference of its own takes its own ref_text"),
    (["--x-vector-only"], "--x-vector-only: given without --ref-audio, whose option it is (how to clone that file)"),
    (["--ref-audio", "missing.wav", "--x-vector-only"], "--ref-audio: reference file not found: "),
    (["--ref-audio", "ref_audio/missing.wav", "--x-vector-only"], "/ref_audio/missing.wav"),   # a path kept as is
    (["--ref-audio", "corpus.txt", "--x-vector-only"], "is not audio that libsndfile reads"),
    (["--ref-audio", "https://example.com/voice.wav", "--x-vector-only"],
     "--ref-audio: 'https://example.com/voice.wav' is a URL: tts reads local files only"),
    (["--model", str(REPO / "tests" / "fixtures" / "tiny-1.7b-voicedesign"), "--instruct", "Calm. " * 400],
     "--instruct: text is 2399 characters, over the limit of 2000 (instructs)"),
    (["--language", "klingon", "--ref-audio", "me.wav", "--x-vector-only"], "--language: unknown language 'klingon'"),
    (["--model", str(cli.BUNDLED_MODEL_DIR), "--ref-audio", "me.wav", "--x-vector-only"],
     "--ref-audio: this checkpoint (custom_voice) cannot clone a voice"),
    (["--model", str(cli.BUNDLED_MODEL_DIR), "--speaker", "nobody"], "--speaker: unknown speaker 'nobody'; valid: "),
    (["--model", str(REPO / "tests" / "fixtures" / "tiny-1.7b-voicedesign"), "--speaker", "vivian"],
     "--speaker: speaker 'vivian': a VoiceDesign checkpoint has no named speakers"),
])
def test_voice_options_the_checkpoint_cannot_take_stop_the_run_before_it_loads(tmp_path, monkeypatch, options,
                                                                               message):
    """The options are the voice of every row that names none: a value the checkpoint cannot take is one
    red line and exit 2 before anything is loaded or written, not a failure of each row after loading."""
    monkeypatch.chdir(tmp_path)
    sf.write(tmp_path / "me.wav", np.sin(np.arange(30000) / 7) * 0.3, 24000, subtype="PCM_16")
    (tmp_path / "corpus.txt").write_text("One line to speak.\n")
    result = runner.invoke(cli.app, ["synth", "corpus.txt", "--out", "out", *OPTIONS, *options])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and message in " ".join(result.stderr.split()), result.stderr
    assert not (tmp_path / "out").exists()


def test_a_file_where_the_reference_cache_goes_stops_a_clone_run_before_it_loads(tmp_path, monkeypatch):
    """OUT/.references is the folder of the encoded references: a file of that name is one red line and exit 2
    before the model loads, not a run that stops at its first clone row with the model loaded."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "load_synthesizer", lambda *a: pytest.fail("the model was loaded"))
    sf.write(tmp_path / "me.wav", np.sin(np.arange(30000) / 7) * 0.3, 24000, subtype="PCM_16")
    (tmp_path / "corpus.txt").write_text("One line to speak.\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / CACHE_DIR_NAME).write_text("")
    result = runner.invoke(cli.app, ["synth", "corpus.txt", "--out", "out", *OPTIONS, "--ref-audio", "me.wav",
                                     "--x-vector-only"])
    assert result.exit_code == 2, result.output
    assert result.stderr.count("error:") == 1 and (
        f"error: --out out: {Path('out') / CACHE_DIR_NAME} is a file, not the folder the encoded references are "
        "kept in: move it away or use another --out") in " ".join(result.stderr.split()), result.stderr
    assert "synthesis failed" not in result.stderr
    assert [p.name for p in (tmp_path / "out").iterdir()] == [CACHE_DIR_NAME]   # no ledger: no run started


def test_an_instruct_the_checkpoint_ignores_is_left_out_of_the_rows_settings(tmp_path, monkeypatch):
    """A CustomVoice 0.6B takes no instruction (the official code drops it): the rows' instruct is left out
    of them with a note (even one that would fail its row), so the report does not show a voice that was
    not made, and a rerun without --instruct resumes the rows instead of refusing them as changed; so does
    a rerun over a ledger that recorded one (as runs before 2026-12-05 did)."""
    from tts_cli.job import params_key

    monkeypatch.chdir(tmp_path)
    pq.write_table(pa.table({"text": ["One line to speak.", "And another."], "instruct": [None, "Calm\x07."]}),
                   tmp_path / "m.parquet")
    model = ["--model", str(REPO / "tests" / "fixtures" / "tiny-0.6b-customvoice"), "--max-frames", "2", "--no-wer"]
    first = runner.invoke(cli.app, ["synth", "m.parquet", "--out", "out", *model, "--instruct", "Angry <think>."])
    assert first.exit_code == 0, first.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [(row["instruct"], row["error"]) for row in report["rows"]] == [(None, None), (None, None)]
    assert ("instruct left out of 2 rows: this checkpoint takes no instruction (the official implementation "
            "ignores it too)") in report["notes"]
    again = runner.invoke(cli.app, ["synth", "m.parquet", "--out", "out", *model])
    assert again.exit_code == 0 and "2 rows ok (2 from an earlier run)" in again.output, again.output
    ledger = tmp_path / "out" / LEDGER_NAME   # as an earlier version wrote it: the instruct in the settings
    entries = [json.loads(line) for line in ledger.read_text().splitlines()]
    for entry in entries:
        entry["params"]["instruct"] = "Angry."
        entry["key"] = params_key(entry["params"])
    ledger.write_text("".join(json.dumps(entry) + "\n" for entry in entries))
    again = runner.invoke(cli.app, ["synth", "m.parquet", "--out", "out", *model, "--instruct", "Angry."])
    assert again.exit_code == 0 and "2 rows ok (2 from an earlier run)" in again.output, again.output


def test_rows_made_before_are_kept_when_their_reference_is_gone(tmp_path, monkeypatch):
    """A rerun after a reference file was removed keeps the rows an earlier run made with it (their
    other settings unchanged), with a note; a row that was not made yet fails with the reason."""
    monkeypatch.chdir(tmp_path)
    for name in ("gone.wav", "kept.wav"):
        sf.write(tmp_path / name, np.sin(np.arange(30000) / 7) * 0.3, 24000, subtype="PCM_16")
    table = {"id": ["a", "b", "c"], "text": ["One line.", "Two lines.", "Three lines."],
             "ref_audio": ["gone.wav", "kept.wav", "gone.wav"], "x_vector_only": [True] * 3}
    pq.write_table(pa.table({name: values[:2] for name, values in table.items()}), tmp_path / "m.parquet")
    assert runner.invoke(cli.app, ["synth", "m.parquet", "--out", "out", *OPTIONS]).exit_code == 0
    made = {name: (tmp_path / "out" / name).read_bytes() for name in ("a.wav", "b.wav")}
    (tmp_path / "gone.wav").unlink()
    pq.write_table(pa.table(table), tmp_path / "m.parquet")
    result = runner.invoke(cli.app, ["synth", "m.parquet", "--out", "out", *OPTIONS])
    assert result.exit_code == 1, result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    a, b, c = report["rows"]
    assert a["error"] is None and a["file"] == "a.wav" and b["error"] is None
    assert c["error"] == f"reference file not found: {tmp_path / 'gone.wav'}" and c["file"] is None
    assert report["totals"]["resumed"] == 2 and report["totals"]["failed"] == 1
    assert ("1 rows made by an earlier run are kept though their reference cannot be read now (first: row 1: "
            f"reference file not found: {tmp_path / 'gone.wav'})") in report["notes"]
    assert {name: (tmp_path / "out" / name).read_bytes() for name in ("a.wav", "b.wav")} == made
    # with the text changed too, the row is not the one made before: it fails for its reference
    pq.write_table(pa.table({**table, "text": ["One changed line.", *table["text"][1:]]}), tmp_path / "m.parquet")
    result = runner.invoke(cli.app, ["synth", "m.parquet", "--out", "out", *OPTIONS])
    a = json.loads((tmp_path / "out" / "report.json").read_text())["rows"][0]
    assert a["error"] == f"reference file not found: {tmp_path / 'gone.wav'}" and result.exit_code == 1


def test_a_reference_replaced_by_an_unusable_file_is_a_changed_row(tmp_path, monkeypatch):
    """A reference file that is there but no longer usable (here cut to 0.5 s) is not a gone one: the
    rows made with its earlier bytes are changed rows, which stop the run; with --redo-changed they
    fail with the reason, their earlier files left as they were. The same bytes made unusable only
    by a stricter check would be kept."""
    monkeypatch.chdir(tmp_path)
    wave = np.sin(np.arange(30000) / 7) * 0.3
    sf.write(tmp_path / "ref.wav", wave, 24000, subtype="PCM_16")
    pq.write_table(pa.table({"id": ["a"], "text": ["One line."], "ref_audio": ["ref.wav"], "x_vector_only": [True]}),
                   tmp_path / "m.parquet")
    assert runner.invoke(cli.app, ["synth", "m.parquet", "--out", "out", *OPTIONS]).exit_code == 0
    made = (tmp_path / "out" / "a.wav").read_bytes()

    def stricter(mono, sample_rate, path):
        raise ReferenceAudioError(f"reference {path} fails a stricter check")
    with monkeypatch.context() as patched:
        patched.setattr(reference_audio, "check_samples", stricter)
        result = runner.invoke(cli.app, ["synth", "m.parquet", "--out", "out", *OPTIONS])
    assert result.exit_code == 0 and "1 rows ok (1 from an earlier run)" in result.output, result.output
    assert "are kept though their reference cannot be read now" in result.output
    sf.write(tmp_path / "ref.wav", wave[:12000], 24000, subtype="PCM_16")
    result = runner.invoke(cli.app, ["synth", "m.parquet", "--out", "out", *OPTIONS])
    assert result.exit_code == 2, result.output
    assert "1 rows were made before with other text or settings (first: row 1, id 'a': ref_audio_sha256" in \
        " ".join(result.output.split())
    result = runner.invoke(cli.app, ["synth", "m.parquet", "--out", "out", "--redo-changed", *OPTIONS])
    assert result.exit_code == 1, result.output
    row = json.loads((tmp_path / "out" / "report.json").read_text())["rows"][0]
    assert "shorter than 1 s" in row["error"] and row["file"] is None
    assert (tmp_path / "out" / "a.wav").read_bytes() == made


def test_worker_processes_take_the_references_the_parent_encoded(tmp_path, monkeypatch):
    """--gpus cpu,cpu: the parent encodes each reference once, the batches carry it to the workers, and
    its audio is the in-process run's."""
    monkeypatch.chdir(tmp_path)
    sf.write(tmp_path / "me.wav", np.sin(np.arange(30000) / 7) * 0.3, 24000, subtype="PCM_16")
    (tmp_path / "corpus.txt").write_text("First line to speak.\nSecond line to speak.\n")
    common = ["--ref-audio", "me.wav", "--ref-text", "A tone.", "--batch-size", "1", *OPTIONS]
    pooled = runner.invoke(cli.app, ["synth", "corpus.txt", "--out", "pool", "--gpus", "cpu,cpu", *common])
    assert pooled.exit_code == 0, pooled.output
    assert "references: 1 used by this run's rows, 1 encoded" in pooled.output
    local = runner.invoke(cli.app, ["synth", "corpus.txt", "--out", "local", *common])
    assert local.exit_code == 0, local.output
    for name in ("000001.wav", "000002.wav"):
        pooled_audio, _ = sf.read(tmp_path / "pool" / name)
        local_audio, _ = sf.read(tmp_path / "local" / name)
        assert len(pooled_audio) > 0
        # one 16-bit step at most: a worker may run torch with more threads (another summation order)
        np.testing.assert_allclose(pooled_audio, local_audio, rtol=0, atol=1.5 / 32768)


def test_voice_design_and_base_rows_take_no_default_speaker(tmp_path, monkeypatch):
    """--speaker defaults to vivian on CustomVoice checkpoints only: a VoiceDesign corpus speaks with
    --instruct alone, and a Base row without a reference fails for that, not for a speaker."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("One line to speak.\n")
    design = runner.invoke(cli.app, ["synth", "corpus.txt", "--out", "design", *OPTIONS[2:], "--model",
                                     str(REPO / "tests" / "fixtures" / "tiny-1.7b-voicedesign"),
                                     "--instruct", "A calm, low voice."])
    assert design.exit_code == 0, design.output
    [row] = json.loads((tmp_path / "design" / "report.json").read_text())["rows"]
    assert row["speaker"] is None and row["instruct"] == "A calm, low voice." and row["frames"] > 0
    assert not any("without an instruct" in note for note in json.loads((tmp_path / "design" / "report.json")
                                                                         .read_text())["notes"])
    undescribed = runner.invoke(cli.app, ["synth", "corpus.txt", "--out", "undescribed", *OPTIONS[2:], "--model",
                                          str(REPO / "tests" / "fixtures" / "tiny-1.7b-voicedesign")])
    assert undescribed.exit_code == 0, undescribed.output
    assert json.loads((tmp_path / "undescribed" / "report.json").read_text())["notes"] == [
        "VoiceDesign rows without an instruct: nothing describes their voice, so each row's comes from its seed and "
        "changes from row to row (give --instruct or a column instruct)"]
    base = runner.invoke(cli.app, ["synth", "corpus.txt", "--out", "base", *OPTIONS])
    assert base.exit_code == 2 and not (tmp_path / "base").exists()
    assert ("error: a Base checkpoint clones a voice, and no row of corpus.txt names one: give --ref-audio"
            in base.stderr)
    pq.write_table(pa.table({"text": ["One line to speak."], "ref_audio": pa.array([None], pa.string())}),
                   tmp_path / "m.parquet")
    base = runner.invoke(cli.app, ["synth", "m.parquet", "--out", "base", *OPTIONS])
    assert base.exit_code == 2 and "no row of m.parquet names one" in base.stderr
    pq.write_table(pa.table({"text": ["One line to speak.", "Two."], "ref_audio": [None, "me.wav"],
                             "x_vector_only": [None, True]}), tmp_path / "m.parquet")
    sf.write(tmp_path / "me.wav", np.sin(np.arange(30000) / 7) * 0.3, 24000, subtype="PCM_16")
    base = runner.invoke(cli.app, ["synth", "m.parquet", "--out", "base", *OPTIONS])
    assert base.exit_code == 1
    plain, clone = json.loads((tmp_path / "base" / "report.json").read_text())["rows"]
    assert plain["error"] == "a Base checkpoint clones a voice: the row needs a reference (ref_audio)"
    assert clone["error"] is None and clone["frames"] > 0


def test_help_shows_how_to_clone_a_voice_for_a_whole_corpus():
    result = runner.invoke(cli.app, ["synth", "--help"], env={"COLUMNS": "200"})
    help_text = " ".join(result.output.split())
    assert ("Clone a voice for a whole corpus (a Base checkpoint): tts synth corpus.txt --out DIR "
            "--model BASE_DIR --ref-audio voice.wav --ref-text \"what voice.wav says\"") in help_text


def test_a_reference_edited_after_the_manifest_was_read_fails_its_rows_alone(tmp_path, monkeypatch):
    """The ledger key holds the hash taken when the manifest was read: a file that changes before it
    is encoded would be another voice under that key, so its rows fail and the others go on."""
    from tts_cli import manifest as manifest_module

    monkeypatch.chdir(tmp_path)
    for name, step in (("steady.wav", 7), ("edited.wav", 9)):
        sf.write(tmp_path / name, np.sin(np.arange(30000) / step) * 0.3, 24000, subtype="PCM_16")
    pq.write_table(pa.table({"id": ["a", "b", "c"], "text": ["First.", "Second.", "Third."],
                             "ref_audio": ["steady.wav", "edited.wav", "edited.wav"], "x_vector_only": [True] * 3}),
                   tmp_path / "m.parquet")
    read = manifest_module.read_manifest

    def read_then_edit(*args, **kwargs):
        manifest = read(*args, **kwargs)
        sf.write(tmp_path / "edited.wav", np.sin(np.arange(30000) / 5) * 0.3, 24000, subtype="PCM_16")
        return manifest

    monkeypatch.setattr(manifest_module, "read_manifest", read_then_edit)
    result = runner.invoke(cli.app, ["synth", "m.parquet", "--out", "out", *OPTIONS])
    assert result.exit_code == 1, result.output
    rows = json.loads((tmp_path / "out" / "report.json").read_text())["rows"]
    assert rows[0]["error"] is None and rows[0]["frames"] > 0
    for row in rows[1:]:
        assert f"reference {tmp_path / 'edited.wav'} changed while the run was going" in row["error"]
    assert json.loads((tmp_path / "out" / "report.json").read_text())["references"]["references_encoded"] == 1


def test_a_synthesizer_note_is_printed_once(tmp_path):
    """A note the synthesizer makes mid-run (here: VoiceDesign rows without an instruct) is one `note:` line at
    the run's end, not also a bare log line on stderr without -v."""
    (tmp_path / "corpus.txt").write_text("One line to speak.\n")
    command, env = synth_command([str(tmp_path / "corpus.txt"), *OPTIONS[2:], "--model",
                                  str(REPO / "tests" / "fixtures" / "tiny-1.7b-voicedesign")], tmp_path / "out")
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("VoiceDesign rows without an instruct") == 1, run.stderr
    assert "note: VoiceDesign rows without an instruct" in run.stderr


def test_ctrl_c_while_the_manifests_references_are_read_stops_at_once_and_writes_nothing(tmp_path, monkeypatch):
    """Every distinct reference file is read before the model loads (minutes for a corpus whose rows each
    have their own): a Ctrl-C there stops the run at once, before --out is made, not after the last file."""
    import signal

    from tts_cli import manifest as manifest_module

    monkeypatch.chdir(tmp_path)
    for k in range(3):
        sf.write(tmp_path / f"ref-{k}.wav", np.sin(np.arange(30000) / (5 + k)) * 0.3, 24000, subtype="PCM_16")
    pq.write_table(pa.table({"text": ["First.", "Second.", "Third."],
                             "ref_audio": [f"ref-{k}.wav" for k in range(3)], "x_vector_only": [True] * 3}),
                   tmp_path / "m.parquet")
    check, read = manifest_module.check_reference, []

    def ctrl_c_on_the_first(path):
        read.append(path)
        signal.raise_signal(signal.SIGINT)   # (its handler runs before this returns)
        return check(path)

    monkeypatch.setattr(manifest_module, "check_reference", ctrl_c_on_the_first)
    result = runner.invoke(cli.app, ["synth", "m.parquet", "--out", "out", *OPTIONS])
    assert result.exit_code == 130, result.output
    assert read == [str(tmp_path / "ref-0.wav")]
    assert not (tmp_path / "out").exists()
    assert result.stderr == "stopped by SIGINT before any row was recorded in out; rerun the same command to start it\n"
