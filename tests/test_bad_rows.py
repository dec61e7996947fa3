"""Bad input: a fuzzed manifest of malformed rows mixed with good ones, and file-level problems."""
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf
from typer.testing import CliRunner

from tts_cli import cli
from tts_cli.errors import TTSError
from tts_cli.manifest import RowDefaults, read_manifest

from fakes import use_fake_synthesizer

runner = CliRunner()
MAX_TEXT_CHARS = 60
CONTROL_CHARACTERS = ["\x00", "\x01", "\x07", "\x0b", "\x0c", "\x1b", "\x7f", "\x85", "\x9f"]


def _bad_rows(rng: random.Random, count: int) -> list[tuple[bytes, bytes, str | None, str | None, str]]:
    """(id, text, speaker, language, expected reason) for `count` malformed rows of every kind."""
    kinds = [
        lambda n: (b"", b"   ", None, None, "empty text"),
        lambda n: (b"", ("word " * rng.randint(13, 40)).encode(), None, None,
                   f"over the limit of {MAX_TEXT_CHARS}"),
        lambda n: (b"", b"caf\xe9 " + bytes([rng.randint(0x80, 0xff)]) * rng.randint(1, 3), None, None,
                   "invalid UTF-8 in the text"),
        lambda n: (b"id-\xc3(" + str(n).encode(), b"Fine text.", None, None, "invalid UTF-8 in the id"),
        lambda n: (b"", f"Hi{rng.choice(CONTROL_CHARACTERS)}there.".encode(), None, None,
                   "text contains control character U+"),
        lambda n: (b"", b"Nice words.", rng.choice(["nobody", "Vivian2", "x"]), None, "unknown speaker"),
        lambda n: (b"", b"Nice words.", None, rng.choice(["klingon", "en", "latin"]), "unknown language"),
        lambda n: (rng.choice([b"a/b", b"../x", b"x\\y", b"dir/../../etc"]) + str(n).encode(), b"Words.", None, None,
                   "contains a path separator"),
        lambda n: (rng.choice([b"..", b"x..y", b"..hidden"]) + str(n).encode(), b"Words.", None, None,
                   "contains '..'"),
        lambda n: (b"dup-" + str(n % 7).encode(), b"Duplicated id.", None, None, "duplicate id"),
    ]
    return [kinds[n % len(kinds)](n) for n in range(count)]


@pytest.fixture
def fake(monkeypatch, tmp_path):
    return use_fake_synthesizer(monkeypatch, tmp_path)


def test_fuzzed_manifest_reports_every_bad_row_and_synthesizes_every_good_one(fake, tmp_path):
    rng = random.Random(6)
    good = [(f"good-{n}".encode(), f"Good sentence {n}, spoken fine.".encode(), rng.choice([None, "ryan"]),
             rng.choice([None, "english"]), None) for n in range(100)]
    bad = _bad_rows(rng, 240)
    # Each dup-k id first appears on a good row, so that the later ones are the duplicates.
    good += [(f"dup-{k}".encode(), b"The first of its id.", None, None, None) for k in range(7)]
    rows = good + bad
    rng.shuffle(rows)
    rows.sort(key=lambda row: row[-1] is not None and row[-1] == "duplicate id")   # duplicates after their first
    manifest = tmp_path / "fuzz.parquet"
    pq.write_table(pa.table({
        "id": pa.array([row[0] or None for row in rows], pa.binary()),
        "text": pa.array([row[1] for row in rows], pa.binary()),
        "speaker": [row[2] for row in rows], "language": [row[3] for row in rows]}), manifest)
    out = tmp_path / "out"

    result = runner.invoke(cli.app, ["synth", str(manifest), "--out", str(out), "--model", str(tmp_path / "model"),
                                     "--max-text-chars", str(MAX_TEXT_CHARS), "--batch-size", "16"])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    report = json.loads((out / "report.json").read_text())
    assert len(report["rows"]) == len(rows) and report["totals"]["failed"] == len(bad)
    for row, expected in zip(report["rows"], rows):
        reason = expected[-1]
        if reason is None:
            assert row["error"] is None, row
            assert sf.info(out / row["file"]).frames > 0
        else:
            assert reason in (row["error"] or ""), (row, reason)
            assert row["file"] is None
    files = sorted(p.name for p in out.glob("*.wav"))
    assert len(files) == len(good) and all(".." not in f and "/" not in f for f in files)
    assert "more rows failed: see the report" in result.stderr   # the terminal is not flooded


def test_txt_lines_fail_alone_for_bad_bytes_and_control_characters(tmp_path):
    manifest = tmp_path / "m.txt"
    manifest.write_bytes(b"ok\tFine.\r\nbad\tcaf\xe9\n\x00\tnul id\nform\tfeed\x0chere\n\nlast\tAlso fine.")
    rows = read_manifest(manifest, RowDefaults("vivian", "auto", 0)).rows
    assert [(row.number, row.request.id, row.problem) for row in rows] == [
        (1, "ok", None),
        (2, "bad", "invalid UTF-8 in the text at byte 3"),
        (3, "\x00", "id '\\x00' contains control character U+0000"),
        (4, "form", "text contains control character U+000C at character 5"),
        (6, "last", None),
    ]
    assert rows[1].request.text == "caf\ufffd"


@pytest.mark.parametrize("columns, message", [
    ({"text": [1, 2]}, "column 'text' has type int64; expected string"),
    ({"text": ["a"], "speaker": [3]}, "column 'speaker' has type int64; expected string"),
    ({"text": ["a"], "seed": [1.5]}, "column 'seed', row 1: expected an integer, got 1.5"),
])
def test_bad_parquet_schema_fails_whole_naming_file_and_column(tmp_path, columns, message):
    path = tmp_path / "m.parquet"
    pq.write_table(pa.table(columns), path)
    with pytest.raises(TTSError, match=f"m\\.parquet: {message}"):
        read_manifest(path, RowDefaults("vivian", "auto", 0))


def test_unknown_parquet_columns_are_a_note_of_the_report(tmp_path, monkeypatch):
    """A misspelled column (speakr) is ignored, and the saved report says so, not only the terminal."""
    use_fake_synthesizer(monkeypatch, tmp_path)
    manifest = tmp_path / "m.parquet"
    pq.write_table(pa.table({"id": ["a"], "text": ["Hello there."], "speakr": ["ryan"]}), manifest)
    out = tmp_path / "out"
    result = runner.invoke(cli.app, ["synth", str(manifest), "--out", str(out), "--model", str(tmp_path / "model")])
    assert result.exit_code == 0, result.output
    note = f"{manifest}: ignoring unknown columns speakr"
    assert f"note: {note}" in " ".join(result.stderr.split())
    assert json.loads((out / "report.json").read_text())["notes"] == [note]
    assert f"{note}." in (out / "report.md").read_text()


def test_a_tokenizer_token_written_in_a_rows_text_or_instruct_fails_that_row(tmp_path):
    """The tokenizer's added tokens (tokenizer_config.json: special ones such as <|im_end|>, others such
    as <think>) in a row's text are read as those tokens, not spoken (the official prompt string reads
    them so too): the row fails, naming the token, before any batch; the others go on."""
    from tts_cli.checkpoint import open_checkpoint

    design = Path(__file__).resolve().parent / "fixtures" / "tiny-1.7b-voicedesign"
    assert {"<|im_end|>", "<tts_pad>", "<think>"} <= set(open_checkpoint(design).config.added_tokens)
    pq.write_table(pa.table({"id": ["ok", "text", "instruct", "think"],
                             "text": ["A fine line.", "Say <|im_end|> now.", "Another line.", "Say <think> now."],
                             "instruct": ["Calm.", "Calm.", "A <tts_pad> voice.", "Calm."]}), tmp_path / "m.parquet")
    result = runner.invoke(cli.app, ["synth", str(tmp_path / "m.parquet"), "--out", str(tmp_path / "out"),
                                     "--model", str(design), "--max-frames", "2", "--no-wer"])
    assert result.exit_code == 1, result.output
    ok, text, instruct, think = json.loads((tmp_path / "out" / "report.json").read_text())["rows"]
    assert ok["error"] is None and ok["frames"] == 2
    assert text["error"].startswith("text holds '<|im_end|>', one of the tokenizer's own tokens")
    assert instruct["error"].startswith("instruct holds '<tts_pad>'")
    assert think["error"].startswith("text holds '<think>'")
