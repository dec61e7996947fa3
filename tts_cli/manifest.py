"""Manifest files -> Requests, one per non-empty row.

Accepted formats:
  .txt      one sentence per line, or `id<TAB>text`; a line without an id gets its 1-based line
            number, zero-padded to 6 digits (`000001`).
  .parquet  columns `text` (required), `id`, `speaker`, `language`, `instruct`, `seed` (optional;
            a missing column or a null cell takes the default). A row without an id gets its 1-based
            row number, zero-padded like a txt line.

Rows whose text is empty or whitespace are skipped and counted, not failed.
Speaker and language are lowercased (the checkpoints name them in lowercase). A row without a seed
gets `base_seed + row index`, the row index being its 0-based position in the file, empty rows
included, so a row's seed does not change when other rows are added to or removed from its batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .errors import TTSError
from .request import Request

FORMATS = (".txt", ".parquet")
PARQUET_COLUMNS = ("id", "text", "speaker", "language", "instruct", "seed")


@dataclass
class RowDefaults:
    speaker: str
    language: str
    base_seed: int


@dataclass
class Manifest:
    path: Path
    requests: list[Request]
    skipped_empty: int
    ignored_columns: list[str] = field(default_factory=list)


def read_manifest(path: Path, defaults: RowDefaults) -> Manifest:
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise TTSError(f"{path}: unsupported manifest type {path.suffix or '(no extension)'!r}; "
                       f"accepted: {', '.join(FORMATS)}")
    if not path.is_file():
        raise TTSError(f"manifest not found: {path}")
    if suffix == ".txt":
        return _read_txt(path, defaults)
    return _read_parquet(path, defaults)


def default_id(row_index: int) -> str:
    return f"{row_index + 1:06d}"


def _read_txt(path: Path, defaults: RowDefaults) -> Manifest:
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TTSError(f"{path}: cannot read as UTF-8 text: {e}") from e
    requests, skipped = [], 0
    for index, line in enumerate(lines):
        row_id, tab, text = line.partition("\t")
        if not tab:
            row_id, text = "", line
        text = text.strip()
        if not text:
            skipped += 1
            continue
        requests.append(Request(
            id=row_id.strip() or default_id(index),
            text=text,
            speaker=defaults.speaker.lower(),
            language=defaults.language.lower(),
            seed=defaults.base_seed + index,
        ))
    return Manifest(path, requests, skipped)


def _read_parquet(path: Path, defaults: RowDefaults) -> Manifest:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several unrelated types for a bad file
        raise TTSError(f"{path}: cannot read as parquet: {e}") from e
    if "text" not in table.column_names:
        raise TTSError(f"{path}: missing required column 'text' "
                       f"(columns present: {', '.join(table.column_names) or 'none'})")
    columns = {name: table.column(name).to_pylist()
               for name in PARQUET_COLUMNS if name in table.column_names}
    ignored = [name for name in table.column_names if name not in PARQUET_COLUMNS]

    def cell(name: str, index: int):
        return columns[name][index] if name in columns else None

    requests, skipped = [], 0
    for index in range(table.num_rows):
        text = cell("text", index)
        if text is not None and not isinstance(text, str):
            raise TTSError(f"{path}: column 'text', row {index + 1}: expected a string, "
                           f"got {type(text).__name__}")
        text = (text or "").strip()
        if not text:
            skipped += 1
            continue
        row_id = cell("id", index)
        row_id = default_id(index) if row_id is None or str(row_id).strip() == "" else str(row_id).strip()
        requests.append(Request(
            id=row_id,
            text=text,
            speaker=_string_or(cell("speaker", index), defaults.speaker).lower(),
            language=_string_or(cell("language", index), defaults.language).lower(),
            instruct=_string_or(cell("instruct", index), "") or None,
            seed=_seed(path, row_id, cell("seed", index), defaults.base_seed + index),
        ))
    return Manifest(path, requests, skipped, ignored)


def _string_or(value, default: str) -> str:
    text = "" if value is None else str(value).strip()
    return text or default


def _seed(path: Path, row_id: str, value, default: int) -> int:
    if value is None:
        return default
    # pandas stores an integer column that has nulls as floats.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise TTSError(f"{path}: column 'seed', row id {row_id!r}: expected an integer, got {value!r}")
