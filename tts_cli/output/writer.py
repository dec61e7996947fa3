"""Audio files named by row id, written atomically: a reader or a rerun never sees half a file."""
from __future__ import annotations

import glob
import io
import os
import re
from pathlib import Path

import numpy as np
import soundfile as sf

from ..errors import OutputError

TEMP_SUFFIX = ".tmp"
TEMP_NAME = re.compile(r"\..+\.\d+" + re.escape(TEMP_SUFFIX))   # write_atomically's names
MAX_NAME_CHARS = 200  # leaves room for a collision suffix and ".wav" under the usual 255-byte limit


def sanitize_id(row_id: str) -> str:
    """A file stem made of [A-Za-z0-9._-] only, never `..`, never hidden, never empty."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", row_id)
    name = re.sub(r"\.{2,}", lambda run: "_" * len(run.group()), name)
    if name.startswith("."):
        name = "_" + name[1:]
    return name[:MAX_NAME_CHARS] or "_"


def output_names(row_ids: list[str], extension: str) -> list[str]:
    """One distinct file name per row, in order; later duplicates get `_2`, `_3`, ...

    Names are compared case-insensitively so that they stay distinct on case-insensitive file systems.
    """
    taken: set[str] = set()
    names = []
    for row_id in row_ids:
        stem = sanitize_id(row_id)
        candidate, n = stem, 1
        while candidate.lower() in taken:
            n += 1
            candidate = f"{stem}_{n}"
        taken.add(candidate.lower())
        names.append(f"{candidate}.{extension}")
    return names


def wav_names(row_ids: list[str]) -> list[str]:
    return output_names(row_ids, "wav")


def pcm16(audio: np.ndarray) -> np.ndarray:
    """Samples in [-1, 1] as 16-bit integers: x 32768, rounded to the nearest, clipped. Done here once
    for every format: libsndfile rounds a float sample for FLAC but floors it for WAV (1 LSB apart in
    about half the samples), so the same row would differ by format."""
    audio = np.asarray(audio, dtype=np.float64)
    if np.isnan(audio).any():   # (the row fails with it: NaN has no 16-bit value)
        raise ValueError(f"{int(np.isnan(audio).sum())} of its {audio.size} samples are NaN")
    return np.clip(np.round(audio * 32768), -32768, 32767).astype(np.int16)


def write_audio(path: Path, audio: np.ndarray, sample_rate: int, audio_format: str = "WAV") -> None:
    """16-bit PCM WAV or FLAC (samples outside [-1, 1] clipped: pcm16).

    Raises OSError when libsndfile cannot encode the audio (that row's fault), OutputError when the
    file cannot be written. The audio is encoded in memory and written by Python: libsndfile writing
    to a file reports a full disk as "System error." without the OS's error number.
    """
    try:
        data = encode_audio(audio, sample_rate, audio_format)
    except sf.SoundFileError as e:
        raise OSError(str(e)) from e
    write_atomically(path, lambda tmp: tmp.write_bytes(data))


def write_wav(path: Path, audio: np.ndarray, sample_rate: int) -> None:
    write_audio(path, audio, sample_rate, "WAV")


def encode_audio(audio: np.ndarray, sample_rate: int, audio_format: str = "FLAC") -> bytes:
    """The bytes write_audio would put in a file, for containers such as parquet."""
    buffer = io.BytesIO()
    sf.write(buffer, pcm16(audio), sample_rate, subtype="PCM_16", format=audio_format)
    return buffer.getvalue()


def write_atomically(path: Path, write) -> None:
    """Call write(temporary path) next to `path`, flush it to disk, then rename over `path`:
    readers never see half a file, and after a crash the file is either old or whole.
    Any OSError (disk full, I/O error, read-only folder) is raised as OutputError naming `path`,
    after the temporary file is removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}{TEMP_SUFFIX}")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        raise OutputError(path, e) from e
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass   # a read-only folder, where it was never made


def sync_folder(folder: Path) -> None:
    """Make the renames done in `folder` durable (a file's fsync does not cover its name)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise OutputError(folder, e) from e


def remove_orphaned_temporary_files(path: Path) -> list[str]:
    """Delete the temporary files write_atomically left beside `path` in processes that are gone
    (killed mid-write: SIGKILL runs no cleanup); returns the names. For files that no run lock
    covers (`tts bench --json`): a live process's file is left alone."""
    path = Path(path)
    own = re.compile(re.escape(f".{path.name}.") + r"(\d+)" + re.escape(TEMP_SUFFIX))
    removed = []
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*{TEMP_SUFFIX}"):
        match = own.fullmatch(tmp.name)
        if match and not process_alive(int(match.group(1))):
            tmp.unlink(missing_ok=True)
            removed.append(tmp.name)
    return removed


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:   # EPERM: alive, another user's
        return True
    return True


def remove_temporary_files(folder: Path) -> list[str]:
    """Delete what write_atomically leaves when its process is killed mid-write; returns the names.
    Only safe while no other process writes into `folder` (the run holds its lock)."""
    removed = []
    for path in Path(folder).glob(f".*{TEMP_SUFFIX}"):
        if TEMP_NAME.fullmatch(path.name):   # .NAME.PID.tmp: not any hidden .tmp file of the user's
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed
