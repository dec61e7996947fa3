"""Long text -> segments the talker can speak, and their audio -> one waveform.

A row longer than the segment limit is cut at sentence ends first, then at clause marks, then at
spaces, and only as a last resort inside a word; neighbouring pieces are packed back together up
to the limit, so segments are as long as allowed and few. Each segment gets its own frame cap,
so a paragraph never reaches the talker's context limit.
"""
from __future__ import annotations

import re

import numpy as np

# Cut points, strongest first. Each pattern matches the break *after* which a cut is made, so the
# punctuation stays with the text before it. CJK marks need no following space.
_SENTENCE_END = re.compile(r"(?:(?<=[.!?…])|(?<=[.!?…][\"'”’)\]]))\s+|(?<=[。！？])")
_CLAUSE_END = re.compile(r"(?<=[,;:—–])\s+|(?<=[，；：、])")
_SPACE = re.compile(r"\s+")

CROSSFADE_SECONDS = 0.04   # long enough to hide a click at the seam, too short to hear as overlap


def split_text(text: str, max_chars: int) -> list[str]:
    """`text` as segments of at most `max_chars` characters each, cut at the strongest break available."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    text = text.strip()
    if len(text) <= max_chars:
        return [text] if text else []
    return _pack(_cut(text, max_chars, (_SENTENCE_END, _CLAUSE_END, _SPACE)), max_chars)


def _cut(text: str, max_chars: int, breaks: tuple[re.Pattern, ...]) -> list[str]:
    """Pieces of at most max_chars: cut at the first kind of break, and cut any piece still too
    long at the next kind, down to fixed-width slices."""
    if len(text) <= max_chars:
        return [text]
    if not breaks:
        return [text[i:i + max_chars] for i in range(0, len(text), max_chars)]
    pieces = [piece.strip() for piece in breaks[0].split(text)]
    return [part for piece in pieces if piece for part in _cut(piece, max_chars, breaks[1:])]


def _pack(pieces: list[str], max_chars: int) -> list[str]:
    """Adjacent pieces joined with a space while the result stays within max_chars."""
    segments: list[str] = []
    for piece in pieces:
        if segments and len(segments[-1]) + 1 + len(piece) <= max_chars:
            segments[-1] = f"{segments[-1]} {piece}"
        else:
            segments.append(piece)
    return segments


def crossfade_samples(sample_rate: int) -> int:
    return round(CROSSFADE_SECONDS * sample_rate)


def join_with_crossfade(waves: list[np.ndarray], fade_samples: int) -> np.ndarray:
    """One waveform: each seam overlaps the end of one segment with the start of the next over
    min(fade_samples, both lengths) samples, with linear fades, so the result is
    sum(lengths) - sum(overlaps) samples long."""
    if not waves:
        return np.zeros(0, dtype=np.float32)
    joined = np.asarray(waves[0], dtype=np.float32)
    for wave in waves[1:]:
        wave = np.asarray(wave, dtype=np.float32)
        overlap = min(fade_samples, len(joined), len(wave))
        if overlap == 0:
            joined = np.concatenate([joined, wave])
            continue
        fade_in = np.linspace(0.0, 1.0, overlap + 2, dtype=np.float32)[1:-1]
        seam = joined[-overlap:] * (1.0 - fade_in) + wave[:overlap] * fade_in
        joined = np.concatenate([joined[:-overlap], seam, wave[overlap:]])
    return joined

