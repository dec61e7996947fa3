"""WAV files named by row id, written atomically."""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import soundfile as sf

MAX_NAME_CHARS = 200  # leaves room for a collision suffix and ".wav" under the usual 255-byte limit


def sanitize_id(row_id: str) -> str:
    """A file stem made of [A-Za-z0-9._-] only, never `..`, never hidden, never empty."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", row_id)
    name = re.sub(r"\.{2,}", lambda run: "_" * len(run.group()), name)
    if name.startswith("."):
        name = "_" + name[1:]
    return name[:MAX_NAME_CHARS] or "_"


def wav_names(row_ids: list[str]) -> list[str]:
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
        names.append(candidate + ".wav")
    return names


def write_wav(path: Path, audio: np.ndarray, sample_rate: int) -> None:
    """16-bit PCM WAV (libsndfile clips samples outside [-1, 1]).

    Raises OSError for any failure to write, libsndfile's included.
    """
    try:
        write_atomically(path, lambda tmp: sf.write(tmp, audio, sample_rate, subtype="PCM_16", format="WAV"))
    except sf.SoundFileError as e:
        raise OSError(str(e)) from e


def write_atomically(path: Path, write) -> None:
    """Call write(temporary path) next to `path`, then rename over it: readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
