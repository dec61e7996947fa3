"""Where finished rows go: one WAV or FLAC file per row, or parquet shards of many rows.

A sink takes each row in two steps: `store(name, audio)`, the slow part (encoding, writing), safe
to call from several threads at once, and `add(entry, name, stored)` with what store returned, in
row order. It hands entries back only once their output is durably on disk, so that the ledger
never names an output that a crash could take away.
Parquet shards hold id, text, speaker, language, the audio as a Hugging Face `datasets` Audio
column (struct {bytes: FLAC, path}), sampling_rate and duration; the schema metadata carries
the `datasets` features, so `load_dataset("parquet", ...)` decodes the audio column as Audio.
"""
from __future__ import annotations

import functools
import json
import re
import time
from pathlib import Path

import numpy as np
import soundfile as sf

from .writer import encode_audio, sync_folder, write_atomically, write_audio

FORMATS = ("wav", "flac", "parquet")
PARQUET_ROWS_PER_FILE = 1000   # about 100 MB of FLAC at 5 s per row: few files, bounded memory
# A shard is also written once its first row has waited this long, so that a kill loses at most about
# this much finished work (rows wait in memory until their shard is on disk and in the ledger).
PARQUET_MAX_WAIT_S = 60.0
SHARD_PATTERN = re.compile(r"part-(\d{5,})\.parquet")


def file_extension(output_format: str) -> str:
    """The extension of each row's own audio name (parquet rows carry FLAC bytes)."""
    return "wav" if output_format == "wav" else "flac"


class FileSink:
    """One audio file per row, written atomically as soon as the row is done."""

    def __init__(self, out_dir: Path, output_format: str, sample_rate: int):
        self.out_dir, self.sample_rate = Path(out_dir), sample_rate
        self.audio_format = output_format.upper()
        self._written: list[dict] = []

    def store(self, name: str, audio: np.ndarray) -> None:
        """Writes the row's file; raises OSError when it cannot."""
        write_audio(self.out_dir / name, audio, self.sample_rate, self.audio_format)

    def add(self, entry: dict, name: str, stored: None) -> None:
        self._written.append({**entry, "file": name})

    def durable_entries(self, final: bool = False) -> list[dict]:
        if not self._written:
            return []
        sync_folder(self.out_dir)
        entries, self._written = self._written, []
        return entries


class ParquetSink:
    """Rows buffered and written as parquet shards part-NNNNN.parquet of up to rows_per_file rows, a
    shard as soon as rows_per_file rows wait or the first of them has waited max_wait_s."""

    def __init__(self, out_dir: Path, sample_rate: int, named_files: set[str],
                 rows_per_file: int = PARQUET_ROWS_PER_FILE, max_wait_s: float = PARQUET_MAX_WAIT_S):
        """named_files: every file a line of the folder's ledger names (Ledger.named_files)."""
        self.out_dir, self.sample_rate, self.rows_per_file = Path(out_dir), sample_rate, rows_per_file
        self.max_wait_s = max_wait_s
        self._first_waiting = 0.0   # time.monotonic() when the first row now waiting was added
        # Never a number the ledger names, even for a shard gone from the folder: a row recorded in it
        # would pass as made from the new shard of that name, and a killed run's shard as a completed one.
        names = [p.name for p in self.out_dir.iterdir()] + list(named_files)
        numbers = [int(m.group(1)) for name in names if (m := SHARD_PATTERN.fullmatch(name))]
        self._next_number = max(numbers, default=-1) + 1
        self._rows: list[dict] = []
        self._entries: list[dict] = []

    def store(self, name: str, audio: np.ndarray) -> tuple[bytes, float]:
        """The row's FLAC bytes and duration (the shard is written by durable_entries)."""
        return encode_audio(audio, self.sample_rate, "FLAC"), len(audio) / self.sample_rate

    def add(self, entry: dict, name: str, stored: tuple[bytes, float]) -> None:
        flac, duration = stored
        if not self._rows:
            self._first_waiting = time.monotonic()
        self._rows.append({
            "id": entry["id"], "text": entry["params"]["text"], "speaker": entry["params"]["speaker"],
            "language": entry["params"]["language"], "audio": {"bytes": flac, "path": name},
            "sampling_rate": self.sample_rate, "duration": duration,
        })
        self._entries.append(entry)

    def durable_entries(self, final: bool = False) -> list[dict]:
        """Writes a shard when rows_per_file rows are waiting, or the first has waited max_wait_s (or
        any, when final); a shard holds rows_per_file rows at most (one batch may bring the waiting rows
        past it): those left over came with that batch, and wait for the next shard."""
        entries = []
        while self._rows and (final or len(self._rows) >= self.rows_per_file
                              or time.monotonic() - self._first_waiting >= self.max_wait_s):
            rows, name = self._rows[:self.rows_per_file], f"part-{self._next_number:05d}.parquet"
            write_atomically(self.out_dir / name, lambda tmp: write_shard(tmp, rows, self.sample_rate))
            self._next_number += 1
            entries += [{**entry, "file": name} for entry in self._entries[:len(rows)]]
            self._rows, self._entries = self._rows[len(rows):], self._entries[len(rows):]
            self._first_waiting = time.monotonic()
        if entries:
            sync_folder(self.out_dir)
        return entries


def output_exists(out_dir: Path, entry: dict) -> bool:
    """Whether the file an ok ledger entry names (the row's audio file or its shard) is there."""
    return bool(entry.get("file")) and (Path(out_dir) / entry["file"]).is_file()


def output_intact(out_dir: Path, entry: dict) -> bool:
    """Whether the output an ok ledger entry names (output_exists) reads whole: the row's audio file
    with the entry's length and its last sample there (a FLAC's header keeps its length when the
    file is cut), or its parquet shard with a footer that reads. Our own writes are atomic; this
    catches a file emptied or cut since, which would otherwise count as done."""
    path = Path(out_dir) / entry["file"]
    try:
        if SHARD_PATTERN.fullmatch(path.name):
            stat = path.stat()
            return _shard_footer_reads(str(path), stat.st_mtime_ns, stat.st_size)
        with sf.SoundFile(str(path)) as audio:
            frames, rate = audio.frames, audio.samplerate
            if frames:
                audio.seek(frames - 1)
                if len(audio.read(1)) != 1:
                    return False
    except (RuntimeError, OSError, ValueError):   # libsndfile's errors are RuntimeErrors
        return False
    seconds = entry.get("audio_seconds")
    return seconds is None or abs(frames / rate - seconds) < 0.5 / rate


@functools.lru_cache(maxsize=64)
def _shard_footer_reads(path: str, mtime_ns: int, size: int) -> bool:
    """(once per shard and version: its rows ask one after the other)"""
    import pyarrow.parquet as pq
    pq.read_metadata(path)
    return True


def shard_schema(sample_rate: int):
    import pyarrow as pa

    features = {
        "id": {"dtype": "string", "_type": "Value"},
        "text": {"dtype": "string", "_type": "Value"},
        "speaker": {"dtype": "string", "_type": "Value"},
        "language": {"dtype": "string", "_type": "Value"},
        "audio": {"sampling_rate": sample_rate, "_type": "Audio"},
        "sampling_rate": {"dtype": "int32", "_type": "Value"},
        "duration": {"dtype": "float64", "_type": "Value"},
    }
    return pa.schema([
        ("id", pa.string()), ("text", pa.string()), ("speaker", pa.string()), ("language", pa.string()),
        ("audio", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
        ("sampling_rate", pa.int32()), ("duration", pa.float64()),
    ], metadata={"huggingface": json.dumps({"info": {"features": features}})})


def write_shard(path: Path, rows: list[dict], sample_rate: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows, schema=shard_schema(sample_rate)), path)


def remove_orphan_shards(out_dir: Path, named_files: set[str]) -> list[str]:
    """Shards that no ledger line names were written by a run killed before it could record them:
    their rows count as not made, and a shard made of them again would hold them twice; a folder run
    in wav or flac since would keep a second copy of rows that no ledger line or report names. A
    shard a line named stays, also once its rows were all made again as files (--redo-changed): left
    in place, as a.wav is after --format flac."""
    removed = []
    for path in Path(out_dir).iterdir():
        if SHARD_PATTERN.fullmatch(path.name) and path.name not in named_files:
            path.unlink()
            removed.append(path.name)
    return removed


def make_sink(output_format: str, out_dir: Path, sample_rate: int, named_files: set[str]):
    if output_format == "parquet":
        return ParquetSink(out_dir, sample_rate, named_files)
    return FileSink(out_dir, output_format, sample_rate)
