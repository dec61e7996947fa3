"""Reference audio for voice cloning: a file -> a mono 24 kHz float32 waveform and the SHA-256 of
its bytes, or the reason it cannot be a reference.

Loading follows the official code (qwen-tts-hf 0.1.1.post1, `Qwen3TTSModel._load_audio_to_np` and
`create_voice_clone_prompt`): `librosa.load(path, sr=None, mono=True)` reads the file with
soundfile as float32 and downmixes by the mean over channels; both the speaker encoder and the
speech tokenizer's encoder then take `librosa.resample(wav, orig_sr=sr, target_sr=24000)`, whose
default is soxr at "HQ" quality, padded or cut to ceil(samples x (24000 / sr)). We call soxr the
same way (librosa itself is not needed). No loudness normalisation: the official code has none.

Limits (the official code checks none of these; a bad reference there fails the whole batch or
silently gives a poor voice, here it fails its own row with the reason):
  - at least MIN_SECONDS (1 s) of audio and a source rate of at least MIN_SOURCE_RATE (8 kHz);
  - at most MAX_SECONDS (60 s). The official code has no maximum. In ICL mode the reference's
    frames enter the talker's prompt (12.5 positions per second: 750 at 60 s, in every row that
    uses it, each with its KV memory) and are decoded again before the new speech, whose default
    cap is 2048 frames (max_new_tokens): 60 s keeps the reference a small part of a row's work
    while allowing far longer references than voice cloning is usually given (a few seconds);
  - not silent: RMS above SILENCE_DBFS (-60 dBFS; 16-bit dither is about -90);
  - finite samples (float files can hold NaN or infinities; librosa.resample refuses them).
"""
from __future__ import annotations

import hashlib
import io
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import RequestError
from .limits import MAX_SECONDS, MIN_SECONDS, MIN_SOURCE_RATE, SAMPLE_RATE, SILENCE_DBFS

RESAMPLE_QUALITY = "HQ"       # librosa.resample's default res_type, "soxr_hq"
UNKNOWN_FRAMES = 2 ** 63 - 1  # libsndfile's SF_COUNT_MAX: the frames of a file whose header gives none


class ReferenceAudioError(RequestError):
    """A reference file that cannot be used; the message says why (the row fails, others go on).
    sha256: of the file's bytes where they were read (a file that is there but is no usable reference)."""
    sha256: str | None = None


@dataclass
class ReferenceAudio:
    path: str
    sha256: str                   # of the file's bytes: the cache key and part of the row's ledger key
    waveform: np.ndarray          # [samples] float32, mono, SAMPLE_RATE
    source_sample_rate: int
    channels: int

    @property
    def seconds(self) -> float:
        return len(self.waveform) / SAMPLE_RATE


def resolve_reference_path(value: str, base_dir: Path) -> str:
    """An absolute, normalised path: `value` as given when absolute, else relative to base_dir
    (the manifest's folder for a manifest cell, the working folder for --ref-audio). `..` is
    allowed: the manifest may name any file, as an absolute path could."""
    return os.path.normpath(os.path.join(os.path.abspath(base_dir), os.path.expanduser(value)))


def reference_value_problem(value: str) -> str | None:
    """Why a ref_audio value cannot name a local file, or None. The official loader also takes
    URLs and base64 strings; tts runs offline and reads files only."""
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", value):
        return f"ref_audio {value!r} is a URL: tts reads local files only (download it first)"
    return None


def read_reference_bytes(path: str) -> bytes:
    """The file's bytes, or ReferenceAudioError: missing, a directory, unreadable, empty."""
    if "\x00" in path:
        raise ReferenceAudioError(f"reference path {path!r} contains a NUL character")
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise ReferenceAudioError(f"reference file not found: {path}") from None
    except IsADirectoryError:
        raise ReferenceAudioError(f"reference {path} is a directory, not an audio file") from None
    except OSError as e:
        raise ReferenceAudioError(f"reference file unreadable: {path}: {e.strerror or e}") from None
    if not data:
        raise ReferenceAudioError(f"reference file is empty (0 bytes): {path}")
    return data


def decode_reference(data: bytes, path: str) -> tuple[np.ndarray, int, int]:
    """(mono float32 samples at the file's rate, that rate, channels) as librosa.load(sr=None,
    mono=True) gives them; ReferenceAudioError when libsndfile cannot read the bytes as audio."""
    import soundfile as sf

    try:
        with sf.SoundFile(io.BytesIO(data)) as audio:
            sample_rate = audio.samplerate
            if audio.frames == UNKNOWN_FRAMES:
                # libsndfile decodes such a stream but cannot seek in it, which soundfile's reads do
                raise ReferenceAudioError(f"reference {path} gives no length in its header (a FLAC written to a "
                                          "pipe?): write it again as a file, e.g. as WAV")
            if audio.frames > MAX_SECONDS * sample_rate:   # refused by its header, not decoded first
                check_length(audio.frames / sample_rate, path)
            samples = audio.read(dtype="float32", always_2d=True)
    except (sf.SoundFileError, RuntimeError, ValueError) as e:
        # libsndfile's own words ("Format not recognised.", "Malformed 'fmt ' chunk.", ...), without
        # soundfile's "Error opening <BytesIO object at ...>: " in front.
        reason = getattr(e, "error_string", None) or str(e).strip() or type(e).__name__
        raise ReferenceAudioError(f"reference {path} is not audio that libsndfile reads "
                                  f"(wav, flac, ogg, mp3, ...): {reason}") from None
    channels = samples.shape[1]
    return samples.mean(axis=1, dtype=np.float32), int(sample_rate), channels


def check_samples(mono: np.ndarray, sample_rate: int, path: str) -> None:
    """ReferenceAudioError unless the samples make a usable reference (limits: module docstring)."""
    if mono.size == 0:
        raise ReferenceAudioError(f"reference {path} holds no samples (0 s of audio)")
    if sample_rate < MIN_SOURCE_RATE:
        raise ReferenceAudioError(f"reference {path} is sampled at {sample_rate} Hz, below {MIN_SOURCE_RATE} Hz")
    finite = np.isfinite(mono)
    if not finite.all():
        first = int(np.argmin(finite))
        raise ReferenceAudioError(f"reference {path} has non-finite samples (NaN or infinity; first at "
                                  f"{first / sample_rate:.3f} s)")
    check_length(mono.size / sample_rate, path)
    rms = math.sqrt(float(np.mean(np.square(mono, dtype=np.float64))))
    level = 20 * math.log10(rms) if rms > 0 else -math.inf
    if level <= SILENCE_DBFS:
        shown = "digital silence" if rms == 0 else f"RMS {level:.1f} dBFS"
        raise ReferenceAudioError(f"reference {path} is silent ({shown}, at or below {SILENCE_DBFS:g} dBFS)")


def check_length(seconds: float, path: str) -> None:
    # rounded away from the limit, so that the length said never reads as within it (0.99996 s: 0.99, not 1.00)
    if seconds < MIN_SECONDS:
        raise ReferenceAudioError(f"reference {path} is {math.floor(seconds * 100) / 100:.2f} s long, shorter than "
                                  f"{MIN_SECONDS:g} s")
    if seconds > MAX_SECONDS:
        raise ReferenceAudioError(f"reference {path} is {math.ceil(seconds * 100) / 100:.2f} s long, longer than "
                                  f"{MAX_SECONDS:g} s")


def resample_to_24k(mono: np.ndarray, sample_rate: int) -> np.ndarray:
    """librosa.resample(mono, orig_sr=sample_rate, target_sr=24000) with its defaults: soxr HQ,
    then padded with zeros or cut to ceil(samples x ratio); float32 in, float32 out."""
    import soxr

    if sample_rate == SAMPLE_RATE:
        return mono
    resampled = soxr.resample(mono, sample_rate, SAMPLE_RATE, quality=RESAMPLE_QUALITY)
    # librosa's rounding, ratio first: 55125 samples at 44.1 kHz give 30001, not 30000.
    ratio = float(SAMPLE_RATE) / sample_rate
    length = int(np.ceil(mono.shape[-1] * ratio))
    if resampled.shape[-1] < length:
        resampled = np.pad(resampled, (0, length - resampled.shape[-1]))
    return np.asarray(resampled[:length], dtype=mono.dtype)


def file_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_reference(path: str) -> ReferenceAudio:
    """Read, hash, decode, check and resample one reference file; ReferenceAudioError says what is wrong.
    The hash and the samples come from the same read, so they always describe the same bytes."""
    data = read_reference_bytes(path)
    mono, sample_rate, channels = decode_reference(data, path)
    check_samples(mono, sample_rate, path)
    return ReferenceAudio(path, file_sha256(data), resample_to_24k(mono, sample_rate), sample_rate, channels)


def check_reference(path: str) -> str:
    """The file's SHA-256 if it is a usable reference, else ReferenceAudioError (no resampling: the
    manifest checks every reference before the model loads, and keeps only the hash)."""
    data = read_reference_bytes(path)
    sha256 = file_sha256(data)
    try:
        mono, sample_rate, _ = decode_reference(data, path)
        check_samples(mono, sample_rate, path)
    except ReferenceAudioError as e:
        e.sha256 = sha256
        raise
    return sha256
