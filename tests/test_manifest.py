"""Manifest files -> Requests: formats, default ids and seeds, empty rows, and the errors."""
from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tts_cli.errors import TTSError
from tts_cli.job import SEGMENT_SEED_STRIDE, segment_requests
from tts_cli.manifest import RowDefaults, read_manifest

DEFAULTS = RowDefaults(speaker="Vivian", language="auto", base_seed=100)


def _requests(manifest):
    assert all(row.problem is None for row in manifest.rows), [row.problem for row in manifest.rows]
    return [row.request for row in manifest.rows]


def _write_parquet(path, columns):
    pq.write_table(pa.table(columns), path)
    return path


def test_txt_ids_default_to_zero_padded_line_numbers_and_empty_lines_are_counted(tmp_path):
    path = tmp_path / "m.txt"
    path.write_text("\ufeffFirst line.\n\n   \nintro\tSecond line.\n\t\nThird line.  \n", encoding="utf-8")
    manifest = read_manifest(path, DEFAULTS)
    requests = _requests(manifest)
    assert [(r.id, r.text) for r in requests] == [
        ("000001", "First line."), ("intro", "Second line."), ("000006", "Third line.")]
    assert manifest.skipped_empty == 3   # a blank line, a whitespace line, a lone tab
    assert [r.seed for r in requests] == [100, 103, 105]   # base seed + 0-based line index
    assert {(r.speaker, r.language, r.instruct) for r in requests} == {("vivian", "auto", None)}


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"])
def test_txt_lines_end_in_lf_crlf_or_cr_alone(tmp_path, end):
    """CR alone (classic Mac OS text) where the file has no LF: one row a line, not one row of them all."""
    path = tmp_path / "m.txt"
    path.write_bytes(end.join([b"id1\tFirst.", b"id2\tSecond.", b"", b"Third."]) + end)
    manifest = read_manifest(path, DEFAULTS)
    assert [(r.id, r.text) for r in _requests(manifest)] == [("id1", "First."), ("id2", "Second."),
                                                              ("000004", "Third.")]
    assert manifest.skipped_empty == 1


def test_an_id_that_clashes_with_a_line_number_says_so(tmp_path):
    path = tmp_path / "m.txt"
    path.write_text("000002\tfoo one.\nbar two.\nx\tthree.\nx\tfour.\n", encoding="utf-8")
    problems = [row.problem for row in read_manifest(path, DEFAULTS).rows]
    assert problems == [None, "duplicate id '000002' (first used by row 1; a row without an id of its own is named "
                              "by its number)", None, "duplicate id 'x' (first used by row 3)"]


def test_txt_text_may_contain_tabs_after_the_id(tmp_path):
    path = tmp_path / "m.txt"
    path.write_text("a\tone\ttwo\n", encoding="utf-8")
    assert [(r.id, r.text) for r in _requests(read_manifest(path, DEFAULTS))] == [("a", "one\ttwo")]


def test_parquet_optional_columns_fall_back_to_defaults(tmp_path):
    path = _write_parquet(tmp_path / "m.parquet", {
        "id": [7, None, 9, 10],
        "text": ["Hello.", "World.", "Third.", "Again."],
        "speaker": ["Ryan", None, "x", ""],
        "language": [None, "English", None, "chinese"],
        "instruct": [None, "whisper", None, ""],
        "seed": [None, 5, None, 0],
        "duration": [1.0, 2.0, 3.0, 4.0],
    })
    manifest = read_manifest(path, DEFAULTS)
    rows = [(r.id, r.text, r.speaker, r.language, r.instruct, r.seed) for r in _requests(manifest)]
    assert rows == [
        ("7", "Hello.", "ryan", "auto", None, 100),
        ("000002", "World.", "vivian", "english", "whisper", 5),
        ("9", "Third.", "x", "auto", None, 102),
        ("10", "Again.", "vivian", "chinese", None, 0),
    ]
    assert manifest.ignored_columns == ["duration"]


def test_parquet_with_only_a_text_column_and_an_empty_cell(tmp_path):
    path = _write_parquet(tmp_path / "m.parquet", {"text": ["a", None, "b"]})
    manifest = read_manifest(path, DEFAULTS)
    assert [(row.request.id, row.request.seed, row.problem) for row in manifest.rows] == [
        ("000001", 100, None), ("000002", 101, "empty text"), ("000003", 102, None)]


def test_parquet_without_text_column_names_file_and_column(tmp_path):
    path = _write_parquet(tmp_path / "m.parquet", {"id": ["a"], "sentence": ["Hello."]})
    with pytest.raises(TTSError, match=r"m\.parquet: missing required column 'text' \(columns present: id, sentence\)"):
        read_manifest(path, DEFAULTS)


def test_unreadable_parquet_names_file(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(TTSError, match=r"broken\.parquet: cannot read as parquet"):
        read_manifest(path, DEFAULTS)


def test_non_integer_seed_names_column_and_row(tmp_path):
    path = _write_parquet(tmp_path / "m.parquet", {"id": ["a"], "text": ["Hi."], "seed": ["one"]})
    with pytest.raises(TTSError, match=r"m\.parquet: column 'seed' has type string; expected integer"):
        read_manifest(path, DEFAULTS)


def test_unknown_extension_names_accepted_ones(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text("id,text\n")
    with pytest.raises(TTSError, match=r"m\.csv: unsupported manifest type '\.csv'; accepted: \.txt, \.parquet"):
        read_manifest(path, DEFAULTS)


def test_a_folder_given_as_the_manifest_is_named_as_one(tmp_path):
    for name in ("corpus", "corpus.txt"):
        (tmp_path / name).mkdir()
        with pytest.raises(TTSError, match=f"{name}: a folder, not a manifest file"):
            read_manifest(tmp_path / name, DEFAULTS)


def test_a_row_seed_beyond_64_bits_fails_that_row_only(tmp_path):
    """Seeds are signed 64-bit integers: a base seed at the top of the range gives its first row that
    seed, and the next rows' (base + index) wrap as 64-bit arithmetic does, as do the segments' of a
    split row; a parquet row's own seed past the range fails that row with the reason."""
    path = tmp_path / "m.txt"
    path.write_text("One.\nTwo.\n")
    top = 2**63 - 1
    rows = read_manifest(path, RowDefaults(speaker="vivian", language="auto", base_seed=top)).rows
    assert [(row.problem, row.request.seed) for row in rows] == [(None, top), (None, -2**63)]
    long_row = replace(rows[0].request, text="One sentence of the row. " * 4)
    assert [r.seed for r in segment_requests(long_row, 40)] == [top + k * SEGMENT_SEED_STRIDE - 2**64 * (k > 0)
                                                                for k in range(4)]
    path = _write_parquet(tmp_path / "m.parquet", {"text": ["One.", "Two.", "Three."],
                                                   "seed": pa.array([2**63, 5, 2**64 - 1], pa.uint64())})
    rows = read_manifest(path, DEFAULTS).rows
    assert [row.problem is None for row in rows] == [False, True, False] and rows[1].request.seed == 5
    assert rows[0].problem.startswith(f"seed {2**63} is not a signed 64-bit integer")


def test_missing_manifest_names_path(tmp_path):
    with pytest.raises(TTSError, match=r"manifest not found: .*nope\.txt"):
        read_manifest(tmp_path / "nope.txt", DEFAULTS)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be"])
def test_a_utf16_txt_is_refused_whole(tmp_path, encoding):
    """With or without a byte-order mark: its lines would be rows of NUL characters and stray bytes."""
    path = tmp_path / "windows.txt"
    path.write_text("Hello there.\nSecond line.\nThird line.\n", encoding=encoding)
    with pytest.raises(TTSError, match=r"windows\.txt: cannot read as UTF-8 text: it looks like UTF-16"):
        read_manifest(path, DEFAULTS)


def test_a_row_of_only_invisible_characters_is_empty(tmp_path):
    path = tmp_path / "m.txt"
    path.write_text("zw\t\u200b\u200b\nzwj\t\u200d \u2060\nok\tWord\u200bjoined.\n")
    rows = read_manifest(path, DEFAULTS).rows
    assert [row.problem for row in rows] == ["empty text: only invisible formatting characters (zero-width ...)"] * 2 \
        + [None]


def test_txt_that_is_not_utf8_names_file(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(TTSError, match=r"latin1\.txt: cannot read as UTF-8 text"):
        read_manifest(path, DEFAULTS)
