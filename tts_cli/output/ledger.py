"""ledger.jsonl: the append-only record of a run's finished rows, what makes a run resumable.

One JSON line per finished row (ok or failed), appended only after the row's output file has been
renamed into place and flushed, then fsync'd. A rerun reads it to skip rows already done and
rebuilds the report from it; a killed run loses at most the rows whose line was not yet written,
and those are redone. A row is matched by id and by `key`, a hash of everything that shapes its
audio, so a row whose text or settings changed is found, not silently mixed with old output.
The output folder is locked while a run writes into it, so two runs never interleave.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

from ..errors import OutputError, TTSError
from ..request import Request

LEDGER_NAME = "ledger.jsonl"
LOCK_NAME = ".tts-lock"


def row_params(request: Request, settings: dict) -> dict:
    """Everything that decides a row's output: its own fields and the run settings that shape audio.
    The seed is left out of greedy runs, where it changes nothing. A cloned voice enters by its
    reference's content hash (not its path: a moved file is the same voice, an edited one is not);
    rows without one keep the keys they had before cloning existed."""
    voice = ({"ref_audio_sha256": request.ref_audio_sha256, "ref_text": request.ref_text,
              "x_vector_only": request.x_vector_only} if request.clones_voice else {})
    return {"text": request.text, "speaker": request.speaker, "language": request.language,
            "instruct": request.instruct, "seed": None if settings.get("greedy") else request.seed, **voice,
            **settings}


def params_key(params: dict) -> str:
    canonical = json.dumps(params, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:32]


def changed_params(old: dict, new: dict) -> str:
    """'max_frames 6 -> 8, text' style summary of what differs."""
    parts = []
    for name in sorted(set(old) | set(new)):
        if old.get(name) != new.get(name):
            parts.append(name if name == "text" else f"{name} {old.get(name)!r} -> {new.get(name)!r}")
    return ", ".join(parts)


class FolderLock:
    """The lock of an output folder (flock on .tts-lock), taken by take() and held until close(). take()
    raises TTSError when another run holds it, OutputError when it cannot be taken (a read-only folder)."""

    def __init__(self, out_dir: Path):
        self.out_dir, self.fd = Path(out_dir), None

    def take(self) -> None:
        try:
            self.fd = _lock_folder(self.out_dir)
        except OSError as e:
            raise OutputError(self.out_dir / LOCK_NAME, e) from e

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Ledger:
    """The ledger of one output folder, opened for appending; takes the folder's lock and holds it until
    closed, or takes `lock`, which its caller holds beyond the ledger (through the report) and closes. An
    OSError (disk full, I/O error, read-only folder) is raised as OutputError naming the file."""

    def __init__(self, out_dir: Path, lock: FolderLock | None = None):
        self.path = Path(out_dir) / LEDGER_NAME
        self._own_lock = lock is None
        self._lock = FolderLock(out_dir) if lock is None else lock
        self._lock.take()
        try:
            self.repaired_bytes = _drop_torn_tail(self.path)
            entries = _read_entries(self.path)
            self.latest: dict[str, dict] = {entry["id"]: entry for entry in entries}   # last per id
            # every file a line named, also one whose rows were all recorded again since (a parquet shard
            # before --redo-changed --format wav): a completed run's output, not a killed run's
            self.named_files: set[str] = {entry["file"] for entry in entries if entry.get("file")}
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            self._release()
            raise OutputError(self.path, e) from e
        except BaseException:
            self._release()
            raise

    def append(self, entries: list[dict]) -> None:
        """Write the entries and wait until they are on disk. When that fails, the ledger is cut
        back to what it held before, so that it names no row whose line did not reach the disk
        (unbuffered writes: nothing is left over to be written at close)."""
        if not entries:
            return
        data = "".join(json.dumps(entry, ensure_ascii=False) + "\n" for entry in entries).encode("utf-8")
        size = os.fstat(self._fd).st_size
        try:
            written = 0
            while written < len(data):
                written += os.write(self._fd, data[written:])
            os.fsync(self._fd)
        except OSError as e:
            try:
                os.ftruncate(self._fd, size)
            except OSError:
                pass   # a torn last line is cut off when the ledger is next opened
            raise OutputError(self.path, e) from e
        for entry in entries:
            self.latest[entry["id"]] = entry
        self.named_files.update(entry["file"] for entry in entries if entry.get("file"))

    def close(self) -> None:
        os.close(self._fd)
        self._release()

    def _release(self) -> None:
        if self._own_lock:
            self._lock.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _lock_folder(out_dir: Path) -> int:
    fd = os.open(out_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise TTSError(f"{out_dir}: another tts run is writing into this folder; wait for it, "
                       "or give this run its own --out") from None
    return fd


def _drop_torn_tail(path: Path) -> int:
    """A run killed mid-append leaves a last line without its newline: cut it off, so that the
    next append starts a fresh line (that row is redone). Returns the bytes removed."""
    if not path.is_file():
        return 0
    with open(path, "rb+") as f:
        data = f.read()
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            f.truncate(keep)
            os.fsync(f.fileno())
        return len(data) - keep


def latest_entries(out_dir: Path) -> dict[str, dict]:
    """The last entry per row id of a folder's ledger, read without its lock (a last line still being
    written is left out); empty where there is no ledger."""
    return {entry["id"]: entry for entry in _read_entries(Path(out_dir) / LEDGER_NAME, whole_lines_only=True)}


def _read_entries(path: Path, whole_lines_only: bool = False) -> list[dict]:
    if not path.is_file():
        return []
    entries = []
    with open(path, "rb") as f:   # decoded line by line: a line that is not UTF-8 is named as any bad line
        for number, line in enumerate(f, 1):
            if whole_lines_only and not line.endswith(b"\n"):
                break
            try:
                entry = json.loads(line.decode("utf-8"))
                entry["id"], entry["key"], entry["status"]
                _check_fields(entry)
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                # json's own position counts the lines of what it parsed (the line's newline: "line 2")
                reason = f"{e.msg} at character {e.pos + 1}" if isinstance(e, json.JSONDecodeError) else e
                raise TTSError(f"{path}, line {number}: not a ledger entry ({reason}); "
                               "fix or remove that line, or use a new --out") from None
            entries.append(entry)
    return entries


# The fields a run reads from an entry, the types it reads them as, and those that may be null: a line that
# parses but holds another type (a hand edit) is refused naming its line, not met later as a traceback.
_NUMBER = (int, float)
_ENTRY_TYPES = {"id": str, "key": str, "status": str, "file": str, "params": dict, "model_fingerprint": str,
                "audio_seconds": _NUMBER, "wall_seconds": _NUMBER, "frames": int, "segment_frames": list,
                "error": str}
_NULLABLE = {"file", "model_fingerprint", "audio_seconds", "wall_seconds", "frames", "segment_frames", "error"}


def _check_fields(entry: dict) -> None:
    for name, types in _ENTRY_TYPES.items():
        value = entry.get(name)
        if name in entry and not isinstance(value, types) and not (value is None and name in _NULLABLE):
            raise TypeError(f"its {name} is {value!r}")
    name = entry.get("file")
    if name is not None and (name in ("", ".", "..") or "/" in name or "\0" in name):   # joined to --out
        raise ValueError(f"its file {name!r} is no file name in the output folder")
