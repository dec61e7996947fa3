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
# punctuation stays with the text before it (with the closing quotes and brackets that follow it).
# CJK marks need no following space; the text's own separator (a space, or none) joins pieces again.
_CLOSING = "\"'”’)\\]」』）】〕》"
_SENTENCE_END = re.compile(rf"(?<=[.!?…])[{_CLOSING}]*\s+|(?<=[。！？])[{_CLOSING}]*(?![{_CLOSING}。！？])\s*")
_CLAUSE_END = re.compile(r"(?<=[,;:—–])\s+|(?<=[，；：、])(?![，；：、])\s*")
_SPACE = re.compile(r"[^\S\u00a0\u202f]+")   # not at a no-break space

CROSSFADE_SECONDS = 0.04   # long enough to hide a click at the seam, too short to hear as overlap


def split_text(text: str, max_chars: int) -> list[str]:
    """`text` as segments of at most `max_chars` characters each, cut at the strongest break available."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    text = text.strip()
    if len(text) <= max_chars:
        return [text] if text else []
    return _pack(_cut(text, "", max_chars, (_SENTENCE_END, _CLAUSE_END, _SPACE)), max_chars)


def _cut(text: str, before: str, max_chars: int, breaks: tuple[re.Pattern, ...]) -> list[tuple[str, str]]:
    """Pieces of at most max_chars, each with the whitespace the text had before it (maybe none;
    `before` for the first): cut at the first kind of break, and any piece still too long at the next
    kind, down to fixed-width slices."""
    if len(text) <= max_chars:
        return [(text, before)]
    if not breaks:
        return [(text[i:i + max_chars], before if i == 0 else "") for i in range(0, len(text), max_chars)]
    pieces, start, separator = [], 0, before
    for cut in breaks[0].finditer(text):
        closing = cut.group().rstrip()   # the closing marks the break pattern took stay with their sentence
        pieces.append((text[start:cut.start()] + closing, separator))
        start, separator = cut.end(), cut.group()[len(closing):]
    pieces.append((text[start:], separator))
    return [part for piece, sep in pieces if piece.strip()
            for part in _cut(piece.strip(), sep, max_chars, breaks[1:])]


def _pack(pieces: list[tuple[str, str]], max_chars: int) -> list[str]:
    """Adjacent pieces joined by the separator they had in the text while the result stays within max_chars."""
    segments: list[str] = []
    for piece, separator in pieces:
        if segments and len(segments[-1]) + len(separator) + len(piece) <= max_chars:
            segments[-1] = f"{segments[-1]}{separator}{piece}"
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

