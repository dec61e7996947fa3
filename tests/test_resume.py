"""Resume: the ledger, atomic outputs, skipping done rows, changed rows, and a run killed for real."""
import json
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import soundfile as sf
from typer.testing import CliRunner

from tts_cli import cli
from tts_cli.errors import TTSError
from tts_cli.job import REDO_PENDING
from tts_cli.output.ledger import LEDGER_NAME, LOCK_NAME, Ledger, params_key
from tts_cli.output.report import NOT_SYNTHESIZED

from fakes import use_fake_synthesizer
from killed_runs import synth_command, synth_killed_after

runner = CliRunner()


@pytest.fixture
def fake(monkeypatch, tmp_path):
    return use_fake_synthesizer(monkeypatch, tmp_path)


def _synth(manifest, out, *options, model=None):
    args = ["synth", str(manifest), "--out", str(out), *map(str, options)]
    if model is not None:
        args += ["--model", str(model)]
    return runner.invoke(cli.app, args)


def _ledger(out):
    return [json.loads(line) for line in (out / LEDGER_NAME).read_text().splitlines()]


def test_rerun_skips_done_rows_and_rebuilds_the_same_report(fake, tmp_path):
    manifest = tmp_path / "m.txt"
    manifest.write_text("a\tOne.\nb\tTwo two.\nc\tThree three three.\n")
    out = tmp_path / "out"
    first = _synth(manifest, out, "--batch-size", 2, model=tmp_path / "model")
    assert first.exit_code == 0, first.output
    report = json.loads((out / "report.json").read_text())
    assert len(fake.batches) == 2

    manifest.write_text("a\tOne.\nb\tTwo two.\nc\tThree three three.\nd\tFour.\n")   # a row added
    second = _synth(manifest, out, "--batch-size", 2, model=tmp_path / "model")
    assert second.exit_code == 0, second.output
    assert fake.batches[2:] == [["d"]]
    rerun = json.loads((out / "report.json").read_text())
    assert rerun["totals"]["resumed"] == 3 and rerun["totals"]["ok"] == 4
    assert [r for r in rerun["rows"] if r["id"] != "d"] == report["rows"]
    assert [e["id"] for e in _ledger(out)] == ["a", "b", "c", "d"]


def test_a_row_that_cannot_be_written_fails_alone_and_the_ledger_keeps_row_order(fake, tmp_path, monkeypatch):
    """A batch's files are written by several threads at once: a row whose audio libsndfile cannot
    encode (an OSError without errno; a full disk stops the run instead: tests/test_signals.py)
    fails that row only, naming the file and the cause; the ledger records the failure, then the
    written rows in manifest order (whichever thread finished first)."""
    from tts_cli.output import formats
    real_write = formats.write_audio

    def write_audio(path, *args):
        if path.name == "c.wav":
            raise OSError("Error : unsupported sample format")
        real_write(path, *args)

    monkeypatch.setattr(formats, "write_audio", write_audio)
    manifest = tmp_path / "m.txt"
    manifest.write_text("".join(f"{name}\tRow {name}, spoken.\n" for name in "abcdefghij"))
    out = tmp_path / "out"
    result = _synth(manifest, out, "--batch-size", 10, model=tmp_path / "model")
    assert result.exit_code == 1, result.output
    report = json.loads((out / "report.json").read_text())
    assert [(r["id"], r["error"]) for r in report["rows"] if r["error"]] == \
        [("c", "cannot write c.wav: Error : unsupported sample format")]
    assert sorted(p.name for p in out.glob("*.wav")) == [f"{name}.wav" for name in "abdefghij"]
    assert [(e["id"], e["status"]) for e in _ledger(out)] == \
        [("c", "failed")] + [(name, "ok") for name in "abdefghij"]


def test_a_missing_output_or_a_failed_row_is_redone(fake, tmp_path):
    manifest = tmp_path / "m.txt"
    manifest.write_text("a\tOne.\nb\tboom two.\n")
    out = tmp_path / "out"
    assert _synth(manifest, out, model=tmp_path / "model").exit_code == 1
    (out / "a.wav").unlink()
    manifest.write_text("a\tOne.\nb\tTwo.\n")   # the failed row was fixed: another key, but it had no output
    result = _synth(manifest, out, model=tmp_path / "model")
    assert result.exit_code == 0, result.output
    assert sf.info(out / "a.wav").frames > 0 and sf.info(out / "b.wav").frames > 0
    assert sorted((e["id"], e["status"]) for e in _ledger(out)) == [("a", "ok"), ("a", "ok"), ("b", "failed"), ("b", "ok")]


@pytest.mark.parametrize("output_format", ["wav", "flac", "parquet"])
def test_an_output_emptied_or_cut_since_is_made_again(fake, tmp_path, output_format):
    """A file an earlier run made, emptied or cut by something else since, does not count as done:
    its rows are made again (an audio file must give the ledger's length and its last sample: a
    FLAC's header keeps its length when cut; a shard's footer must read, and a damaged shard is
    removed), and the report says so; the whole rows' files are not touched. A row whose text or
    settings changed is still refused, damaged or not."""
    manifest = tmp_path / "m.txt"
    manifest.write_text("a\tOne.\nb\tTwo two.\nc\tThree three three.\n")
    out = tmp_path / "out"
    options = ["--format", output_format, "--batch-size", 3 if output_format == "parquet" else 1]
    assert _synth(manifest, out, *options, model=tmp_path / "model").exit_code == 0
    if output_format == "parquet":
        shard = out / _ledger(out)[0]["file"]
        shard.write_bytes(shard.read_bytes()[:-20])
    else:
        (out / f"a.{output_format}").write_bytes(b"")
        whole = (out / f"b.{output_format}").read_bytes()
        (out / f"b.{output_format}").write_bytes(whole[:len(whole) // 2])
        c_before = (out / f"c.{output_format}").stat().st_mtime_ns
    changed = _synth(manifest, out, *options, "--greedy", model=tmp_path / "model")
    assert changed.exit_code == 2 and "3 rows were made before with other text or settings" in changed.output
    result = _synth(manifest, out, *options, model=tmp_path / "model")
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    if output_format == "parquet":
        assert fake.batches[1:] == [["a", "b", "c"]] and report["totals"]["resumed"] == 0
        assert not shard.exists() and all(pq.read_table(out / entry["file"]).num_rows == 3
                                          for entry in _ledger(out)[3:])
        assert any("3 rows made by an earlier run are made again" in note and "1 such parquet shards removed" in note
                   for note in report["notes"])
    else:
        assert fake.batches[3:] == [["a"], ["b"]] and report["totals"]["resumed"] == 1
        assert sf.info(out / f"a.{output_format}").frames > 0 and (out / f"b.{output_format}").read_bytes() == whole
        assert (out / f"c.{output_format}").stat().st_mtime_ns == c_before
        assert any("2 rows made by an earlier run are made again: their file does not read whole (emptied or "
                   f"cut since; first: row 1, a.{output_format})" in note for note in report["notes"])


def test_a_row_new_to_the_folder_does_not_take_the_file_of_a_row_made_before(fake, tmp_path):
    """Ids that differ only where a file name cannot ('a b', 'a_b') or in case: named in manifest order,
    a row inserted before a row made by an earlier run would have taken its file and overwritten it."""
    manifest = tmp_path / "m.txt"
    manifest.write_text("a_b\tFirst text.\n")
    out = tmp_path / "out"
    assert _synth(manifest, out, "--greedy", model=tmp_path / "model").exit_code == 0   # (seeds follow rows)
    made = (out / "a_b.wav").read_bytes()
    manifest.write_text("a b\tInserted row.\nA_B\tAnother.\na_b\tFirst text.\n")
    result = _synth(manifest, out, "--greedy", model=tmp_path / "model")
    assert result.exit_code == 0, result.output
    rows = json.loads((out / "report.json").read_text())["rows"]
    assert [(row["id"], row["file"]) for row in rows] == [("a b", "a_b_2.wav"), ("A_B", "A_B_3.wav"),
                                                          ("a_b", "a_b.wav")]
    assert (out / "a_b.wav").read_bytes() == made
    assert sorted(path.name for path in out.glob("*.wav")) == ["A_B_3.wav", "a_b.wav", "a_b_2.wav"]


def test_another_segment_limit_changes_only_the_rows_longer_than_either_limit(fake, tmp_path):
    manifest = tmp_path / "m.txt"
    manifest.write_text("short\tOne short row.\nlong\tA first sentence here. A second one there. A third.\n")
    out = tmp_path / "out"
    assert _synth(manifest, out, model=tmp_path / "model").exit_code == 0
    result = _synth(manifest, out, "--segment-chars", 200, model=tmp_path / "model")   # both rows: one segment
    assert result.exit_code == 0 and "2 rows ok (2 from an earlier run)" in result.stdout, result.output
    result = _synth(manifest, out, "--segment-chars", 30, model=tmp_path / "model")    # the long row splits
    assert result.exit_code == 2
    assert "1 rows were made before with other text or settings (first: row 2, id 'long': segment_chars" \
        in " ".join(result.stderr.split())


def _ledger_line_before_fingerprints(row_id: str, text: str, seed: int, segment_frames: list[int], model: Path,
                                     segment_chars: int) -> dict:
    """A row's ledger line as runs wrote it before lines held the checkpoint's fingerprint (c46a8bf)."""
    params = {"text": text, "speaker": "vivian", "language": "auto", "instruct": None, "seed": seed,
              "model": str(model.resolve()), "greedy": False, "max_frames": None, "segment_chars": segment_chars,
              "format": "wav"}
    frames = sum(segment_frames)
    return {"id": row_id, "key": params_key(params), "status": "ok", "file": f"{row_id}.wav", "frames": frames,
            "segment_frames": segment_frames if len(segment_frames) > 1 else None,
            "audio_seconds": frames * 1920 / 24000, "wall_seconds": 0.5, "hit_cap": False, "error": None,
            "params": params}


def test_another_segment_limit_is_judged_by_the_limit_the_ledger_recorded(fake, tmp_path):
    """The ledger records the limit a row was split under, not its cuts, and the splitter that cut it may
    not be today's: here an older one cut 'long' in three where today's makes two, at 30 characters as at
    40, so splitting again took another limit for the same output. A rerun with the recorded settings
    resumes every row (a ledger of an earlier version); another limit changes only the rows longer than
    either limit."""
    model, out = tmp_path / "model", tmp_path / "out"
    rows = [("short", "One short row.", [3]),
            ("long", "A first sentence here. A second one there. A third.", [4, 6, 5])]   # (frames per segment)
    manifest = tmp_path / "m.txt"
    manifest.write_text("".join(f"{row_id}\t{text}\n" for row_id, text, _ in rows))
    out.mkdir()
    lines = [_ledger_line_before_fingerprints(row_id, text, seed, frames, model, 30)
             for seed, (row_id, text, frames) in enumerate(rows)]
    (out / LEDGER_NAME).write_text("".join(json.dumps(line) + "\n" for line in lines))
    for line in lines:
        sf.write(out / line["file"], np.zeros(line["frames"] * 1920, dtype=np.float32), 24000, subtype="PCM_16")

    result = _synth(manifest, out, "--segment-chars", 30, model=model)
    assert result.exit_code == 0 and "2 rows ok (2 from an earlier run)" in result.stdout, result.output
    assert fake.batches == []
    result = _synth(manifest, out, "--segment-chars", 40, model=model)
    assert result.exit_code == 2, result.output
    assert ("1 rows were made before with other text or settings (first: row 2, id 'long': segment_chars 30 -> 40)"
            in " ".join(result.stderr.split()))
    assert fake.batches == []


def test_another_checkpoint_put_in_the_model_folder_makes_the_rows_changed(tmp_path, monkeypatch):
    """The ledger names the model by its folder; a line also holds the checkpoint's fingerprint, so
    that a checkpoint replaced in place does not pass its rows off as made (lines without one, of
    runs before it was kept, are taken as they are)."""
    import shutil

    fake = use_fake_synthesizer(monkeypatch, tmp_path)
    model = Path(shutil.copytree(cli.BUNDLED_MODEL_DIR, tmp_path / "model", dirs_exist_ok=True))
    manifest = tmp_path / "m.txt"
    manifest.write_text("a\tOne.\n")
    out = tmp_path / "out"
    assert _synth(manifest, out, model=model).exit_code == 0
    assert _synth(manifest, out, model=model).exit_code == 0 and len(fake.batches) == 1   # resumed
    lines = _ledger(out)
    (out / LEDGER_NAME).write_text("".join(json.dumps({k: v for k, v in e.items() if k != "model_fingerprint"})
                                           + "\n" for e in lines))
    assert _synth(manifest, out, model=model).exit_code == 0 and len(fake.batches) == 1   # an older line: taken
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(data)
    (out / LEDGER_NAME).write_text("".join(json.dumps(e) + "\n" for e in lines))
    result = _synth(manifest, out, model=model)
    assert result.exit_code == 2 and "(first: row 1, id 'a': the checkpoint in the model folder)" in result.stderr
    assert _synth(manifest, out, "--redo-changed", model=model).exit_code == 0 and len(fake.batches) == 2


def test_changed_rows_stop_the_run_before_the_model_loads_unless_redo_changed(fake, tmp_path, monkeypatch):
    manifest = tmp_path / "m.txt"
    manifest.write_text("a\tOne.\nb\tTwo.\n")
    out = tmp_path / "out"
    assert _synth(manifest, out, "--max-frames", 3, model=tmp_path / "model").exit_code == 0
    first_a = (out / "a.wav").read_bytes()

    manifest.write_text("a\tOne, changed.\nb\tTwo.\n")
    monkeypatch.setattr(cli, "load_synthesizer", lambda *a: pytest.fail("the model was loaded"))
    refused = _synth(manifest, out, "--max-frames", 3, model=tmp_path / "model")
    assert refused.exit_code == 2
    assert "1 rows were made before with other text or settings (first: row 1, id 'a': text)" in refused.stderr
    refused = _synth(manifest, out, "--max-frames", 4, model=tmp_path / "model")
    assert "2 rows were made before" in refused.stderr and "max_frames 3 -> 4" in refused.stderr
    assert (out / "a.wav").read_bytes() == first_a   # nothing touched

    monkeypatch.setattr(cli, "load_synthesizer", lambda *a: fake)
    redone = _synth(manifest, out, "--max-frames", 3, "--redo-changed", model=tmp_path / "model")
    assert redone.exit_code == 0, redone.output
    assert fake.batches[-1] == ["a"]
    report = json.loads((out / "report.json").read_text())
    assert report["rows"][0]["text"] == "One, changed." and report["totals"]["resumed"] == 1


def test_ledger_drops_a_torn_last_line_and_locks_the_folder(tmp_path):
    (tmp_path / LEDGER_NAME).write_text('{"id": "a", "key": "k", "status": "ok"}\n{"id": "b", "ke')
    with Ledger(tmp_path) as ledger:
        assert ledger.repaired_bytes == len('{"id": "b", "ke') and list(ledger.latest) == ["a"]
        with pytest.raises(TTSError, match="another tts run is writing into this folder"):
            Ledger(tmp_path)
        ledger.append([{"id": "b", "key": "k", "status": "failed"}])
    assert [e["id"] for e in _ledger(tmp_path)] == ["a", "b"]
    (tmp_path / LEDGER_NAME).write_text('{"id": "a"}\n{"id": "b", "key": "k", "status": "ok"}\n')
    with pytest.raises(TTSError, match=r"ledger.jsonl, line 1: not a ledger entry"):
        Ledger(tmp_path)
    (tmp_path / LEDGER_NAME).write_text('{"id": "a", "key": "k", "status": "ok"}\n{"id"\n{"id": "c"}\n')
    with pytest.raises(TTSError, match=r"ledger.jsonl, line 2: not a ledger entry \(Expecting ':' delimiter at "
                                       r"character 7\); fix or remove that line"):
        Ledger(tmp_path)
    (tmp_path / LEDGER_NAME).write_bytes(b'{"id": "a", "key": "k", "status": "ok"}\n{"id": "b\xff", "key": "k"}\n')
    with pytest.raises(TTSError, match=r"ledger.jsonl, line 2: not a ledger entry \('utf-8' codec can't decode"):
        Ledger(tmp_path)


@pytest.mark.parametrize("field, value, reason", [
    ("file", 5, "its file is 5"), ("audio_seconds", "x", "its audio_seconds is 'x'"),
    ("params", None, "its params is None"), ("file", "{outside}", "is no file name in the output folder")])
def test_a_ledger_line_with_a_field_of_another_type_stops_the_run_naming_it(fake, tmp_path, field, value, reason):
    """A line that parses but holds what no run writes (a hand edit): refused like a line that does not parse,
    not a traceback later, nor a row written where its file field points outside --out."""
    manifest = tmp_path / "m.txt"
    manifest.write_text("a\tOne.\nb\tTwo.\n")
    out, outside = tmp_path / "out", tmp_path / "outside.wav"
    assert _synth(manifest, out, model=tmp_path / "model").exit_code == 0
    lines = _ledger(out)
    lines[1][field] = str(outside) if value == "{outside}" else value
    if field == "params":   # (its params are read only where its key differs)
        lines[1]["key"] = "another"
    (out / LEDGER_NAME).write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = _synth(manifest, out, model=tmp_path / "model")
    assert result.exit_code == 2, result.output
    assert "ledger.jsonl, line 2: not a ledger entry" in result.output and reason in result.output
    assert not outside.exists() and json.loads((out / "report.json").read_text())["totals"]["ok"] == 2


def test_the_folder_stays_locked_until_the_report_is_written(fake, tmp_path, monkeypatch):
    """The lock is not the ledger's alone: a second run starting while this one hears its last rows or
    writes its report would write its own report (or remove rows.parquet) beside this one's."""
    from tts_cli.output import report as report_module
    real_write_reports, second_run = report_module.write_reports, []

    def write_reports(out_dir, *args):
        try:
            Ledger(out_dir).close()   # what a second run into the folder does first
            second_run.append("let in")
        except TTSError as e:
            second_run.append(str(e))
        return real_write_reports(out_dir, *args)

    monkeypatch.setattr(report_module, "write_reports", write_reports)
    manifest = tmp_path / "m.txt"
    manifest.write_text("a\tOne.\n")
    out = tmp_path / "out"
    result = _synth(manifest, out, model=tmp_path / "model")
    assert result.exit_code == 0, result.output
    assert len(second_run) == 1 and "another tts run is writing into this folder" in second_run[0]
    with Ledger(out):   # released at the end
        pass


def test_parquet_shard_that_no_ledger_entry_names_is_removed_and_its_rows_redone(fake, tmp_path):
    manifest = tmp_path / "m.txt"
    manifest.write_text("".join(f"r{i}\tRow number {i}.\n" for i in range(5)))
    out = tmp_path / "out"
    assert _synth(manifest, out, "--format", "parquet", model=tmp_path / "model").exit_code == 0
    (out / LEDGER_NAME).write_text("")   # as if killed after the shard's rename, before its ledger lines
    result = _synth(manifest, out, "--format", "parquet", model=tmp_path / "model")
    assert result.exit_code == 0, result.output
    assert ("removed 1 parquet shards that no ledger line names (a killed run's, written before their rows were "
            "recorded)") in result.stderr
    shards = sorted(out.glob("part-*.parquet"))
    assert [p.name for p in shards] == ["part-00000.parquet"]   # numbered after the orphan went
    assert sorted(pq.read_table(shards[0]).column("id").to_pylist()) == [f"r{i}" for i in range(5)]


@pytest.mark.parametrize("output_format", ["wav", "flac"])
def test_a_killed_parquet_runs_shard_is_removed_by_a_run_in_another_format(fake, tmp_path, output_format):
    """A shard no ledger line names holds rows no run recorded: a folder run in wav or flac since removes it,
    as it empties report_audio/, instead of keeping a copy of rows that no report names. The shards an earlier
    run recorded stay."""
    manifest, other, out = tmp_path / "m.txt", tmp_path / "other.txt", tmp_path / "out"
    manifest.write_text("a\tOne.\nb\tTwo.\n")
    other.write_text("c\tThree.\n")
    assert _synth(manifest, out, "--format", "parquet", model=tmp_path / "model").exit_code == 0
    # as a run killed after its shard's rename, before its ledger lines, leaves it
    (out / "part-00001.parquet").write_bytes((out / "part-00000.parquet").read_bytes())
    result = _synth(other, out, "--format", output_format, model=tmp_path / "model")
    assert result.exit_code == 0, result.output
    note = ("removed 1 parquet shards that no ledger line names (a killed run's, written before their rows were "
            "recorded)")
    assert note in result.stderr and note in json.loads((out / "report.json").read_text())["notes"]
    assert sorted(p.name for p in out.glob("part-*.parquet")) == ["part-00000.parquet"]
    assert list((out / "report_audio").iterdir()) == [] and (out / f"c.{output_format}").is_file()


def test_a_shard_whose_rows_were_made_again_as_files_is_kept_by_a_later_parquet_run(fake, tmp_path):
    """A completed run's shard whose rows were all made again in wav (--redo-changed) is named by no row's
    last ledger line, but it is no killed run's: it stays, as a.wav does after --format flac, also through
    a parquet run of other rows, whose shard takes the next number."""
    manifest, other, out = tmp_path / "m.txt", tmp_path / "other.txt", tmp_path / "out"
    manifest.write_text("a\tOne.\nb\tTwo.\n")
    other.write_text("c\tThree.\n")
    assert _synth(manifest, out, "--format", "parquet", model=tmp_path / "model").exit_code == 0
    assert _synth(manifest, out, "--format", "wav", "--redo-changed", model=tmp_path / "model").exit_code == 0
    result = _synth(other, out, "--format", "parquet", model=tmp_path / "model")
    assert result.exit_code == 0, result.output
    assert "shards" not in result.stderr and json.loads((out / "report.json").read_text())["notes"] == []
    assert pq.read_table(out / "part-00000.parquet").column("id").to_pylist() == ["a", "b"]
    assert pq.read_table(out / "part-00001.parquet").column("id").to_pylist() == ["c"]
    assert [(e["id"], e["file"]) for e in _ledger(out)][-3:] == [
        ("a", "a.wav"), ("b", "b.wav"), ("c", "part-00001.parquet")]


@pytest.mark.parametrize("output_format", ["wav", "parquet"])
def test_an_error_in_synthesis_keeps_the_rows_made_writes_the_report_and_exits_2(fake, tmp_path, output_format):
    """Not a row's fault (a bug, a device fault): the run cannot go on, but it ends as a stopped run
    does, parquet rows still waiting for their shard included."""
    manifest = tmp_path / "m.txt"
    manifest.write_text("a\tOne.\nb\tTwo.\nc\tThree [bug].\nd\tFour.\n")
    out = tmp_path / "out"
    result = _synth(manifest, out, "--batch-size", 2, "--format", output_format, model=tmp_path / "model")
    assert result.exit_code == 2, result.output
    assert ("synthesis failed (ValueError: a bug in synthesis (fake); `tts -v synth ...` shows where): the rows "
            "finished so far are in") in " ".join(result.stderr.split())
    assert [(e["id"], e["status"]) for e in _ledger(out)] == [("a", "ok"), ("b", "ok")]
    report = json.loads((out / "report.json").read_text())
    assert report["totals"]["ok"] == 2 and report["totals"]["not_synthesized"] == 2
    manifest.write_text("a\tOne.\nb\tTwo.\nc\tThree.\nd\tFour.\n")
    assert _synth(manifest, out, "--batch-size", 2, "--format", output_format,
                  model=tmp_path / "model").exit_code == 0
    assert sorted(e["id"] for e in _ledger(out)) == ["a", "b", "c", "d"]


def test_a_row_whose_audio_is_not_finite_fails_alone(fake, tmp_path):
    manifest = tmp_path / "m.txt"
    manifest.write_text("a\tOne.\nb\tTwo [nan].\nc\tThree.\n")
    out = tmp_path / "out"
    result = _synth(manifest, out, "--format", "flac", model=tmp_path / "model")
    assert result.exit_code == 1, result.output
    rows = json.loads((out / "report.json").read_text())["rows"]
    assert [row["error"] for row in rows] == [
        None, "its audio has NaN or infinite samples (the model's numbers overflowed)", None]
    assert sorted(p.name for p in out.glob("*.flac")) == ["a.flac", "c.flac"]


def test_a_stopped_run_reports_the_rows_it_was_to_make_again_as_not_synthesized(fake, tmp_path, monkeypatch):
    """A row to redo (its file gone, or changed with --redo-changed) that a stopped run did not reach is
    not reported with its earlier ledger line; and a redone row's earlier line stops counting before
    its file is replaced, so that a run killed in between leaves it to be redone."""
    import os
    import signal

    manifest = tmp_path / "m.txt"
    manifest.write_text("a\tOne.\nb\tTwo.\nc\tThree.\n")
    out = tmp_path / "out"
    assert _synth(manifest, out, "--greedy", model=tmp_path / "model").exit_code == 0
    (out / "b.wav").unlink()
    manifest.write_text("a\tOne.\nb\tTwo.\nc\tThree, changed.\n")
    synthesize = fake.synthesize
    monkeypatch.setattr(fake, "synthesize", lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGTERM))
    result = _synth(manifest, out, "--greedy", "--redo-changed", model=tmp_path / "model")
    assert result.exit_code == 143, result.output
    report = json.loads((out / "report.json").read_text())
    assert [(row["id"], row["file"], row["error"]) for row in report["rows"]] == [
        ("a", "a.wav", None), ("b", None, NOT_SYNTHESIZED), ("c", None, NOT_SYNTHESIZED)]
    assert report["totals"]["audio_seconds_this_run"] == 0 and report["totals"]["not_synthesized"] == 2
    assert [(e["id"], e["status"], e["error"]) for e in _ledger(out)][-1] == ("c", "failed", REDO_PENDING)
    monkeypatch.setattr(fake, "synthesize", synthesize)
    manifest.write_text("a\tOne.\nb\tTwo.\nc\tThree.\n")   # back to the text c.wav was made from
    result = _synth(manifest, out, "--greedy", model=tmp_path / "model")
    assert result.exit_code == 0 and "3 rows ok (1 from an earlier run)" in result.stdout, result.output


def test_a_row_made_again_in_another_format_gets_a_file_of_that_format(fake, tmp_path):
    manifest = tmp_path / "m.txt"
    manifest.write_text("a\tOne.\n")
    out = tmp_path / "out"
    assert _synth(manifest, out, model=tmp_path / "model").exit_code == 0
    assert _synth(manifest, out, "--format", "flac", "--redo-changed", model=tmp_path / "model").exit_code == 0
    assert sf.info(out / "a.flac").format == "FLAC" and sf.info(out / "a.wav").format == "WAV"
    assert json.loads((out / "report.json").read_text())["rows"][0]["file"] == "a.flac"


def test_rows_waiting_for_their_parquet_shard_are_written_when_due_while_a_long_batch_runs(fake, tmp_path,
                                                                                          monkeypatch):
    """A shard is due once its first row has waited PARQUET_MAX_WAIT_S, also while no other row ends (a long
    batch): else a kill in that batch loses finished rows that waited far longer."""
    from tts_cli import job
    from tts_cli.output.formats import ParquetSink

    monkeypatch.setattr(job, "make_sink", lambda output_format, out_dir, rate, referenced: ParquetSink(
        out_dir, rate, referenced, max_wait_s=0.2))
    real_synthesize, seen = fake.synthesize, []
    manifest, out = tmp_path / "m.txt", tmp_path / "out"
    manifest.write_text("a\tOne.\nb\tTwo.\n")

    def synthesize(requests, **kwargs):
        if requests[0].id == "b":   # the second batch, long: row a waits for its shard meanwhile
            deadline = time.monotonic() + 5
            while not (out / LEDGER_NAME).read_text() and time.monotonic() < deadline:   # (its line follows the shard)
                time.sleep(0.05)
            seen.append((sorted(path.name for path in out.glob("part-*.parquet")), [e["id"] for e in _ledger(out)]))
        return real_synthesize(requests, **kwargs)

    monkeypatch.setattr(fake, "synthesize", synthesize)
    result = _synth(manifest, out, "--format", "parquet", "--batch-size", 1, model=tmp_path / "model")
    assert result.exit_code == 0, result.output
    assert seen == [(["part-00000.parquet"], ["a"])]
    assert pq.read_table(out / "part-00000.parquet").column("id").to_pylist() == ["a"]
    assert [e["file"] for e in _ledger(out)] == ["part-00000.parquet", "part-00001.parquet"]


def test_a_parquet_shard_number_the_ledger_names_is_never_written_again(fake, tmp_path):
    """Its rows were recorded in it: a new shard of that name would pass them as made."""
    manifest = tmp_path / "m.txt"
    manifest.write_text("a\tOne.\nb\tTwo.\n")
    out = tmp_path / "out"
    assert _synth(manifest, out, "--format", "parquet", model=tmp_path / "model").exit_code == 0
    (out / "part-00000.parquet").unlink()
    assert _synth(manifest, out, "--format", "parquet", model=tmp_path / "model").exit_code == 0
    assert [p.name for p in out.glob("part-*.parquet")] == ["part-00001.parquet"]
    assert {e["id"]: e["file"] for e in _ledger(out)} == {"a": "part-00001.parquet", "b": "part-00001.parquet"}


def test_rows_of_an_earlier_run_reach_the_outputs_callback_shard_by_shard(fake, tmp_path, monkeypatch):
    """(WER reads a resumed parquet row from its shard, one shard kept at a time: rows of two shards
    taken in manifest order read each shard once per row.)"""
    from tts_cli.checkpoint import fingerprint
    from tts_cli.job import JobSettings, run_job
    from tts_cli.manifest import RowDefaults, read_manifest
    from tts_cli.output import formats

    monkeypatch.setattr(formats.ParquetSink.__init__, "__defaults__", (2, 60.0))   # 2 rows a shard
    manifest = tmp_path / "m.txt"
    manifest.write_text("".join(f"r{i}\tRow {i}.\n" for i in (0, 2, 4, 1, 3, 5)))
    out = tmp_path / "out"
    assert _synth(manifest, out, "--format", "parquet", "--batch-size", 2, "--greedy",
                  model=tmp_path / "model").exit_code == 0
    manifest.write_text("".join(f"r{i}\tRow {i}.\n" for i in range(6)))
    rows = read_manifest(manifest, RowDefaults("vivian", "auto", 0)).rows
    seen = []
    settings = JobSettings(output_format="parquet", greedy=True, model=str((tmp_path / "model").resolve()),
                           model_fingerprint=fingerprint(tmp_path / "model"))
    run_job(rows, {row.index: f"{row.request.id}.flac" for row in rows}, out, settings,
            start_executor=lambda: pytest.fail("nothing to synthesize"),
            on_output=lambda record, audio, rate: seen.append(record.file))
    assert seen == sorted(seen) and len(seen) == 6 and len(set(seen)) == 3


@pytest.mark.parametrize("output_format, theirs", [
    ("parquet", "part-00000.parquet"), ("wav", "r1.wav"), ("flac", "report.md"), ("wav", "rows.parquet"),
    ("parquet", "report_audio/theirs.flac"), ("wav", "part-00000.parquet"), ("flac", "report_audio/theirs.flac")])
def test_files_under_output_names_in_a_folder_no_run_wrote_stop_the_run(fake, tmp_path, output_format, theirs):
    """No ledger: a file named as an output was not made by tts. It is neither overwritten nor taken for a
    killed run's (a shard would be removed as an orphan, in any format, as would a file in report_audio/),
    and nothing is loaded: exit 2 naming it. A hidden .tmp file of the user's is left alone; only
    write_atomically's names are a killed run's."""
    manifest = tmp_path / "m.txt"
    manifest.write_text("r0\tOne.\nr1\tTwo.\n")
    out = tmp_path / "out"
    (out / theirs).parent.mkdir(parents=True)
    (out / theirs).write_bytes(b"someone else's")
    (out / ".draft.tmp").write_bytes(b"mine")
    result = _synth(manifest, out, "--format", output_format, model=tmp_path / "model")
    assert result.exit_code == 2, result.output
    assert f"error: {out} holds {theirs}, named as this run's outputs, but no ledger.jsonl" in result.stderr
    assert not hasattr(fake, "loaded_with") and (out / theirs).read_bytes() == b"someone else's"
    assert not (out / LEDGER_NAME).exists() and not (out / LOCK_NAME).exists()   # the folder as it was
    (out / theirs).unlink()
    assert _synth(manifest, out, "--format", output_format, model=tmp_path / "model").exit_code == 0
    assert (out / ".draft.tmp").read_bytes() == b"mine"


@pytest.mark.skipif(not (cli.BUNDLED_MODEL_DIR / "config.json").is_file(), reason="the bundled model is missing")
def test_sigkill_mid_run_then_rerun_gives_each_row_one_whole_output(tmp_path):
    """Acceptance: `tts synth` on the bundled model, SIGKILLed mid-run, then the same command again."""
    rows = 12
    manifest = tmp_path / "m.txt"
    manifest.write_text("".join(f"row-{i:02d}\tSentence number {i} of the kill test.\n" for i in range(rows)))
    out = tmp_path / "out"
    arguments = [str(manifest), "--max-frames", "3", "--batch-size", "2", "--greedy", "--no-wer"]
    synth_killed_after(arguments, out, rows=4, timeout=60)
    done_before = {e["id"] for e in _ledger(out)}
    assert 4 <= len(done_before) < rows
    # What a kill can also leave: a half-written file and a torn ledger line.
    (out / ".row-11.wav.99999.tmp").write_bytes(b"RIFF")
    with open(out / LEDGER_NAME, "a") as ledger:
        ledger.write('{"id": "row-2')

    command, env = synth_command(arguments, out)
    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert f"{rows} rows ok ({len(done_before)} from an earlier run)" in second.stdout
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([f"row-{i:02d}.wav" for i in range(rows)] + [
        ".tts-lock", "ledger.jsonl", "report.html", "report.json", "report.md"])
    report = json.loads((out / "report.json").read_text())
    assert [r["id"] for r in report["rows"]] == [f"row-{i:02d}" for i in range(rows)]
    for row in report["rows"]:
        audio, rate = sf.read(out / row["file"])
        assert row["error"] is None and rate == 24000 and len(audio) == row["frames"] * 1920 > 0
    entries = _ledger(out)
    assert sorted({e["id"] for e in entries}) == [f"row-{i:02d}" for i in range(rows)]
    assert len(entries) == rows   # rows done before the kill were not done again
