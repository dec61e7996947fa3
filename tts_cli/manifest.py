"""Manifest files -> ManifestRows, each a Request and, for a row that cannot be synthesized, why.

Accepted formats:
  .txt      one sentence per line, or `id<TAB>text`; a line without an id gets its 1-based line
            number, zero-padded to 6 digits (`000001`). Lines are split at `\\n` only and decoded
            one by one, so a line that is not UTF-8 fails alone.
  .parquet  columns `text` (required; string or binary holding UTF-8), `id`, `speaker`, `language`,
            `instruct`, `seed`, `ref_audio`, `ref_text`, `x_vector_only` (optional; a missing column
            or a null cell takes the default). A row without an id gets its 1-based row number,
            zero-padded like a txt line.

Voice cloning: a row with `ref_audio` (a path relative to the manifest's folder, or absolute;
for a .txt manifest, and for parquet rows without one, RowDefaults.ref_audio, from --ref-audio)
clones that reference's voice: in ICL mode with `ref_text`, its transcript, or from the speaker
embedding alone with `x_vector_only`. Every distinct reference file is read once here, before
any model loads: a bad one (tts_cli/voice/reference_audio.py says what that is) fails the rows
that use it, and each good one's SHA-256 goes into its rows' requests (and so their ledger keys).

File-level problems (unreadable file, wrong column types, no `text` column) raise TTSError naming
the file, column and row. Row-level problems (empty or over-long text, invalid UTF-8, control
characters, duplicate ids, ids with path separators or `..`) mark the row with its reason; the
other rows go on. Blank txt lines are layout, not rows: they are skipped and counted.

Speaker and language are lowercased (the checkpoints name them in lowercase). A row without a seed
gets `base_seed + row index`, the row index being its 0-based position in the file, blank lines
included, so a row's seed does not change when other rows are added to or removed from its batch.
"""
from __future__ import annotations

import os
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

from .errors import TTSError
from .recipe import SEED_RANGE, wrapped_seed
from .request import Request
from .textsplit import is_empty_text
from .voice.checks import voice_fields_problem
from .voice.reference_audio import (ReferenceAudioError, check_reference, reference_value_problem,
                                    resolve_reference_path)

FORMATS = (".txt", ".parquet")
PARQUET_COLUMNS = ("id", "text", "speaker", "language", "instruct", "seed", "ref_audio", "ref_text", "x_vector_only")
DEFAULT_MAX_TEXT_CHARS = 10_000
# An instruct describes a voice or a style in a sentence or a few, and each of its tokens is a talker
# position of every segment of its row (the official code sets no limit). On the CPU path a lockstep
# batch's attention masks grow with the square of its longest prompt: 60,000 characters of instruct
# asked 47 GB of the tiny model.
MAX_INSTRUCT_CHARS = 2_000
# Whitespace that may appear inside a text; every other control character is refused.
ALLOWED_CONTROLS = "\t\n\r"


@dataclass
class RowDefaults:
    speaker: str | None           # None: rows name their own (Base and VoiceDesign checkpoints have none)
    language: str
    base_seed: int
    max_text_chars: int = DEFAULT_MAX_TEXT_CHARS
    # The voice of rows that name none (--instruct, --ref-audio, --ref-text, --x-vector-only);
    # ref_audio is relative to the working folder.
    instruct: str | None = None
    ref_audio: str | None = None
    ref_text: str | None = None
    x_vector_only: bool = False
    # False for a checkpoint that ignores instructions (CustomVoice 0.6B, as the official code does): a
    # row's instruct is then left out of it (the report says so), not a setting a rerun must repeat.
    takes_instruct: bool = True
    # What sets max_text_chars, as its messages name it: the Python API's keyword (the Ray path's) is no CLI option.
    max_text_chars_name: str = "--max-text-chars"


@dataclass
class ManifestRow:
    index: int                    # 0-based line or row number in the file
    request: Request
    problem: str | None = None    # why the row cannot be synthesized; None for a good row
    reference_unreadable: bool = False   # the problem is its reference file (a row done before may be kept)
    instruct_left_out: bool = False      # it gave one, which its checkpoint ignores (RowDefaults.takes_instruct)

    @property
    def number(self) -> int:
        """1-based, as editors and messages count lines."""
        return self.index + 1


@dataclass
class Manifest:
    path: Path
    rows: list[ManifestRow]
    skipped_empty: int
    ignored_columns: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)   # what the reading changed, for the report

    @property
    def good_rows(self) -> list[ManifestRow]:
        return [row for row in self.rows if row.problem is None]


def read_manifest(path: Path, defaults: RowDefaults, references: bool = True) -> Manifest:
    path = Path(path)
    suffix = path.suffix.lower()
    if path.is_dir():
        raise TTSError(f"{path}: a folder, not a manifest file (.txt or .parquet)")
    if suffix not in FORMATS:
        raise TTSError(f"{path}: unsupported manifest type {path.suffix or '(no extension)'!r}; "
                       f"accepted: {', '.join(FORMATS)}")
    if not path.is_file():
        raise TTSError(f"manifest not found: {path}")
    manifest = _read_txt(path, defaults) if suffix == ".txt" else _read_parquet(path, defaults)
    drop_unused_ref_text(manifest)
    note_left_out_instructs(manifest)
    mark_duplicate_ids(manifest.rows)
    if references:   # (tts score hears the rows' audio: their references are no business of its)
        check_references(manifest.rows)
    return manifest


def drop_unused_ref_text(manifest: Manifest) -> None:
    """An x_vector_only clone reads no transcript: its ref_text would only be part of its settings (a
    rerun without it would count as a change), so it is left out, and the report says so."""
    unused = [row for row in manifest.rows if row.request.x_vector_only and row.request.ref_text]
    for row in unused:
        row.request.ref_text = None
    if unused:
        manifest.notes.append(f"ref_text left out of {len(unused)} x_vector_only rows: they clone from the "
                              "reference's speaker embedding alone, which reads no transcript")


def note_left_out_instructs(manifest: Manifest) -> None:
    left_out = sum(row.instruct_left_out for row in manifest.rows)
    if left_out:
        manifest.notes.append(f"instruct left out of {left_out} rows: this checkpoint takes no instruction (the "
                              "official implementation ignores it too)")


def default_id(row_index: int) -> str:
    return f"{row_index + 1:06d}"


def text_problem(text: str, max_chars: int, limit: str = "--max-text-chars") -> str | None:
    """Why a (stripped, decoded) text cannot be spoken, or None; limit: what sets max_chars."""
    if is_empty_text(text):
        return "empty text" if not text.strip() else "empty text: only invisible formatting characters (zero-width ...)"
    bad = _first_control_character(text)
    if bad is not None:
        return f"text contains control character U+{ord(text[bad]):04X} at character {bad + 1}"
    if len(text) > max_chars:
        return f"text is {len(text)} characters, over the limit of {max_chars} ({limit})"
    return None


def id_problem(row_id: str) -> str | None:
    """Ids name output files and appear in reports: refuse those that look like paths."""
    if "/" in row_id or "\\" in row_id:
        return f"id {row_id!r} contains a path separator"
    if ".." in row_id:
        return f"id {row_id!r} contains '..'"
    bad = _first_control_character(row_id)
    if bad is not None:
        return f"id {row_id!r} contains control character U+{ord(row_id[bad]):04X}"
    return None


def mark_duplicate_ids(rows: list[ManifestRow], first_numbers: dict[str, int] | None = None) -> None:
    """The first row with an id keeps it; later rows with the same id fail, naming the first. first_numbers: where
    the rows are a part of the manifest (a Ray batch), the manifest's repeated_ids, for ids first used in another."""
    first_number = dict(first_numbers or {})
    for row in rows:
        number = first_number.setdefault(row.request.id, row.number)
        if number != row.number and row.problem is None:
            # a row without an id is named by its number: say so where that is what clashed
            named = row.request.id in (default_id(number - 1), default_id(row.index))
            row.problem = (f"duplicate id {row.request.id!r} (first used by row {number}"
                           + ("; a row without an id of its own is named by its number" if named else "") + ")")


def check_references(rows: list[ManifestRow]) -> None:
    """Read each distinct reference file of the good rows once: a bad one fails its rows with the
    reason, a good one's SHA-256 goes into their requests, and so does a bad one's where its bytes
    were read (a row made before with other bytes is then a changed row: tts_cli.job)."""
    outcomes: dict[str, str | ReferenceAudioError] = {}
    for row in rows:
        path = row.request.ref_audio
        if path is None or row.problem is not None:
            continue
        if path not in outcomes:
            try:
                outcomes[path] = check_reference(path)
            except ReferenceAudioError as e:
                outcomes[path] = e
        outcome = outcomes[path]
        if isinstance(outcome, ReferenceAudioError):
            row.problem, row.reference_unreadable = str(outcome), True
            row.request.ref_audio_sha256 = outcome.sha256
        else:
            row.request.ref_audio_sha256 = outcome


def _first_control_character(text: str) -> int | None:
    for i, char in enumerate(text):
        if char not in ALLOWED_CONTROLS and unicodedata.category(char) == "Cc":
            return i
    return None


def _decode(data: bytes, what: str) -> tuple[str, str | None]:
    """UTF-8 text and None, or a readable stand-in and the problem."""
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError as e:
        return data.decode("utf-8", errors="replace"), f"invalid UTF-8 in the {what} at byte {e.start}"


def _row_id(index: int, given: str | None) -> str:
    """A row's id: the given one stripped, or where there is none (or it is blank) its row number."""
    return default_id(index) if given is None or not given.strip() else given.strip()


def _make_row(index: int, row_id: str | None, text: str, defaults: RowDefaults, *, speaker=None,
              language=None, instruct=None, seed=None, ref_audio=None, ref_text=None, x_vector_only=None,
              base_dir: Path | None = Path("."), problem: str | None = None) -> ManifestRow:
    """base_dir: the folder a ref_audio cell is relative to (the manifest's); None for a remote manifest's."""
    text = text.strip()
    row_id = _row_id(index, row_id)
    # A transcript is of one file: --ref-text goes with --ref-audio, a row's ref_text with its ref_audio.
    # --x-vector-only says how to clone --ref-audio's file: a row with a reference of its own takes only
    # its own x_vector_only (one without may set the mode for --ref-audio's).
    own_reference, own_transcript = bool(_string_or(ref_audio, "")), bool(_string_or(ref_text, ""))
    given_instruct = _string_or(instruct, (defaults.instruct or "").strip()) or None
    x_vector_only, flag_problem = _flag(x_vector_only, defaults.x_vector_only and not own_reference)
    pairing_problem = (own_transcript and not own_reference and defaults.ref_audio and
                       "ref_text without ref_audio in its row: a row's transcript is of its own reference, and "
                       "this row takes --ref-audio's (whose transcript is --ref-text)")
    request = Request(
        id=row_id, text=text,
        speaker=_string_or(speaker, defaults.speaker or "").lower() or None,
        language=_string_or(language, defaults.language).lower(),
        instruct=given_instruct if defaults.takes_instruct else None,
        seed=wrapped_seed(defaults.base_seed + index) if seed is None else seed,
        ref_audio=_reference_path(ref_audio, defaults, base_dir),
        ref_text=_string_or(ref_text, "" if own_reference else (defaults.ref_text or "").strip()) or None,
        x_vector_only=x_vector_only,
    )
    ref_text_problem = request.ref_text and text_problem(request.ref_text, defaults.max_text_chars,
                                                         defaults.max_text_chars_name)
    instruct_problem = request.instruct and text_problem(request.instruct, MAX_INSTRUCT_CHARS, "instructs")
    ref_audio_problem = (reference_value_problem(_string_or(ref_audio, defaults.ref_audio or ""))
                         or (base_dir is None and own_reference and not os.path.isabs(request.ref_audio)
                             and f"ref_audio {request.ref_audio!r} is relative to a remote manifest (a URI): tts "
                                 "reads reference files from local paths only; give an absolute path that every "
                                 "actor can read"))
    problem = (problem or id_problem(row_id)
               or text_problem(text, defaults.max_text_chars, defaults.max_text_chars_name) or flag_problem
               or seed_problem(request.seed) or ref_audio_problem or pairing_problem
               or (ref_text_problem and f"ref_text: {ref_text_problem}")
               or (instruct_problem and f"instruct: {instruct_problem}")
               or voice_fields_problem(request))
    return ManifestRow(index, request, problem, instruct_left_out=bool(given_instruct) and not defaults.takes_instruct)


def seed_problem(seed: int) -> str | None:
    low, high = SEED_RANGE
    if not low <= seed <= high:
        return f"seed {seed} is not a signed 64-bit integer (from {low} to {high})"
    return None


def _reference_path(cell, defaults: RowDefaults, base_dir: Path | None) -> str | None:
    """The row's reference file: its cell relative to base_dir, else the default relative to the
    working folder, else None (no cloning)."""
    if _string_or(cell, "") and base_dir is None:   # a remote manifest's: a relative cell fails its row (_make_row)
        return os.path.normpath(os.path.expanduser(_string_or(cell, "")))
    if _string_or(cell, ""):
        return resolve_reference_path(_string_or(cell, ""), base_dir)
    return default_reference_path(defaults.ref_audio)


def default_reference_path(ref_audio: str | None) -> str | None:
    """The file of --ref-audio (the Ray path's ref_audio=), relative to the working folder; None when it is
    not given or blank: a blank value names no reference, as an empty ref_audio cell does."""
    if ref_audio and ref_audio.strip():
        return resolve_reference_path(ref_audio.strip(), Path.cwd())
    return None


def _flag(value, default: bool) -> tuple[bool, str | None]:
    """An x_vector_only cell: true/false, or 0/1 (integer columns); None takes the default."""
    if value is None:
        return default, None
    if isinstance(value, bool) or value in (0, 1):
        return bool(value), None
    return default, f"x_vector_only must be true or false (or 1 or 0), got {value!r}"


def _read_txt(path: Path, defaults: RowDefaults) -> Manifest:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TTSError(f"{path}: cannot read: {e}") from e
    if data.startswith((b"\xff\xfe", b"\xfe\xff")) or data[:200].count(b"\0") > len(data[:200]) // 4:
        # UTF-16 (what Windows calls Unicode): its NUL bytes and split newlines would make rows of garbage
        raise TTSError(f"{path}: cannot read as UTF-8 text: it looks like UTF-16 (a byte-order mark or NUL "
                       "bytes); save it as UTF-8")
    data = data.removeprefix(b"\xef\xbb\xbf")
    # Lines end in LF or CRLF; in CR alone where the file has no LF (classic Mac OS text, as some
    # spreadsheet exports still write it), which would otherwise be one row holding every line.
    lines = data.split(b"\n" if b"\n" in data or b"\r" not in data else b"\r")
    if lines[-1] == b"":
        lines.pop()   # what follows the final newline is not a line
    rows, skipped = [], 0
    for index, line in enumerate(lines):
        line = line.removesuffix(b"\r")
        if not line.strip():
            skipped += 1
            continue
        id_bytes, tab, text_bytes = line.partition(b"\t")
        if not tab:
            id_bytes, text_bytes = b"", line
        row_id, id_error = _decode(id_bytes, "id")
        text, text_error = _decode(text_bytes, "text")
        rows.append(_make_row(index, row_id, text, defaults, problem=id_error or text_error))
    if rows and all(row.problem and row.problem.startswith("invalid UTF-8") for row in rows):
        raise TTSError(f"{path}: cannot read as UTF-8 text: no line decodes (first: row {rows[0].number}: "
                       f"{rows[0].problem})")
    return Manifest(path, rows, skipped)


# Arrow types each column may have: checked before any row is read, so a wrong schema fails whole.
def _is_text(t) -> bool:
    import pyarrow as pa
    if pa.types.is_dictionary(t):   # pandas' category columns
        return _is_text(t.value_type)
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) \
        or pa.types.is_large_binary(t) or pa.types.is_null(t)


def _is_id(t) -> bool:
    import pyarrow as pa
    return _is_text(t) or pa.types.is_integer(t)


def _is_seed(t) -> bool:
    import pyarrow as pa
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_null(t)


def _is_flag(t) -> bool:
    import pyarrow as pa   # (pandas stores an integer column that has nulls as floats)
    return pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_null(t)


COLUMN_TYPES = {"text": (_is_text, "string"), "id": (_is_id, "string or integer"),
                "speaker": (_is_text, "string"), "language": (_is_text, "string"),
                "instruct": (_is_text, "string"), "seed": (_is_seed, "integer"),
                "ref_audio": (_is_text, "string (a path)"), "ref_text": (_is_text, "string"),
                "x_vector_only": (_is_flag, "boolean, or numbers 1 and 0")}


def _read_parquet(path: Path, defaults: RowDefaults) -> Manifest:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several unrelated types for a bad file
        raise TTSError(f"{path}: cannot read as parquet: {e}") from e
    check_schema(table.schema, path)
    ignored = [name for name in table.column_names if name not in PARQUET_COLUMNS]
    return Manifest(path, rows_from_table(table, defaults, path, path.parent), 0, ignored)


def check_schema(schema, source) -> None:
    """A `text` column, and the known columns of usable types; raises TTSError naming `source`."""
    if "text" not in schema.names:
        raise TTSError(f"{source}: missing required column 'text' (columns present: {', '.join(schema.names) or 'none'})")
    for name, (accepts, expected) in COLUMN_TYPES.items():
        if name in schema.names and not accepts(schema.field(name).type):
            raise TTSError(f"{source}: column '{name}' has type {schema.field(name).type}; expected {expected}")


def rows_from_table(table, defaults: RowDefaults, source, base_dir: Path | None = Path("."),
                    indexes: list[int] | None = None) -> list[ManifestRow]:
    """The rows of a table that passed check_schema; row indexes count from the table's first row, or are
    `indexes`, the rows' in the manifest where the table is a part of it (a Ray batch); relative ref_audio paths
    start from base_dir (the manifest's folder; None for a remote manifest, whose rows with a relative one fail). A
    seed that is not an integer (1.5 in a float column) raises TTSError, as check_seeds does."""
    columns = {name: _cells(table, name) for name in PARQUET_COLUMNS}
    rows = []
    for position, index in enumerate(range(table.num_rows) if indexes is None else indexes):
        cells = {name: values[position] for name, values in columns.items()}
        problems = []
        for name in ("id", "text", "speaker", "language", "instruct", "ref_audio", "ref_text"):
            if isinstance(cells[name], bytes):
                cells[name], problem = _decode(cells[name], name)
                problems.append(problem)
        row_id = None if cells["id"] is None else str(cells["id"])
        seed = _seed(source, index, cells["seed"])
        rows.append(_make_row(
            index, row_id, cells["text"] or "", defaults, speaker=cells["speaker"], language=cells["language"],
            instruct=cells["instruct"], seed=seed, ref_audio=cells["ref_audio"],
            ref_text=cells["ref_text"], x_vector_only=cells["x_vector_only"], base_dir=base_dir,
            problem=next((p for p in problems if p), None)))
    return rows


def check_seeds(table, source) -> None:
    """Raises TTSError naming `source` and the row, as rows_from_table does, at the first seed of the table (one that
    passed check_schema) that is not an integer: for a manifest whose rows are made in parts (Ray batches), before
    any part is."""
    for index, cell in enumerate(_cells(table, "seed")):
        _seed(source, index, cell)


def repeated_ids(table) -> dict[str, int]:
    """Each id that more than one row of the table (one that passed check_schema) has, with the number of its first
    row: for mark_duplicate_ids on parts of the table, which see only their own rows. Ids as rows_from_table gives
    them (a blank one is its row's default_id)."""
    first_number: dict[str, int] = {}
    repeated = {}
    for index, cell in enumerate(_cells(table, "id")):
        given = _decode(cell, "id")[0] if isinstance(cell, bytes) else None if cell is None else str(cell)
        row_id = _row_id(index, given)
        number = first_number.setdefault(row_id, index + 1)
        if number != index + 1:
            repeated[row_id] = number
    return repeated


def _cells(table, name: str) -> list:
    """A column's cells, None for each where the table has no such column."""
    import pyarrow as pa

    if name not in table.column_names:
        return [None] * table.num_rows
    values = table.column(name)
    if pa.types.is_dictionary(values.type):
        values = values.cast(values.type.value_type)
    # Strings travel as bytes so that a cell that is not UTF-8 fails alone, not the whole column.
    if _is_text(values.type) and not pa.types.is_null(values.type):
        values = values.cast(pa.large_binary())
    return values.to_pylist()


def _string_or(value, default: str) -> str:
    text = "" if value is None else str(value).strip()
    return text or default


def _seed(source, index: int, value) -> int | None:
    # pandas stores an integer column that has nulls as floats.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if value is None or isinstance(value, int):
        return value
    raise TTSError(f"{source}: column 'seed', row {index + 1}: expected an integer, got {value!r}")
