"""Long text -> segments the talker can speak, and their audio -> one waveform.

A row longer than the segment limit is cut at sentence ends first, then at clause marks, then at
spaces, and only as a last resort inside a word; neighbouring pieces are packed back together up
to the limit, so segments are as long as allowed and few. Each segment gets its own frame cap,
so a paragraph never reaches the talker's context limit.
"""
from __future__ import annotations

import re
import unicodedata

import numpy as np


# Cut points, strongest first. Each pattern matches the break *after* which a cut is made, so the
# punctuation stays with the text before it (with the closing quotes and brackets that follow it,
# French ones after a no-break space). A line break ends a sentence. CJK marks need no following
# space, nor do ASCII ones before CJK text; the text's own separator (a space, or none) joins pieces
# again. Never at a no-break space.
_CJK_CLOSING = "\"'”’)\\]」』）】〕》"
_CLOSING = _CJK_CLOSING + "“»›"   # “ closes German quotes (and opens Chinese ones)
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f"   # kana, ideographs
_GAP = r"[^\S\u00a0\u202f]"   # whitespace but the no-break spaces
_SENTENCE_END = re.compile(rf"(?<=[.!?…])(?:[\u00a0\u202f]?[{_CLOSING}])*{_GAP}+"
                           rf"|(?<=[.!?])[{_CJK_CLOSING}]*(?=[{_CJK}])"
                           rf"|(?<=[。！？．｡])[{_CJK_CLOSING}]*(?![{_CJK_CLOSING}。！？．｡])\s*"
                           r"|\n\s*")   # (the spaces before a line break: stripped with the piece)
_CLAUSE_END = re.compile(rf"(?<=[,;:—–]){_GAP}+|(?<=[,;:])(?=[{_CJK}])|(?<=[，；：、､])(?![，；：、､])\s*")
_SPACE = re.compile(rf"{_GAP}+")
# Characters a fixed-width cut does not go before: they belong to the character before them.
_JOINS_BACK = re.compile(r"[\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe00-\ufe0f\ufe20-\ufe2f\u200c\u200d]"
                         r"|[\U0001f3fb-\U0001f3ff\U000e0100-\U000e01ef]")

CROSSFADE_SECONDS = 0.04   # long enough to hide a click at the seam, too short to hear as overlap


def is_empty_text(text: str) -> bool:
    """Whether text has nothing to speak: it is whitespace and invisible formatting characters (zero-width
    spaces and joiners, direction marks: category Cf) alone, or nothing."""
    return all(char.isspace() or unicodedata.category(char) == "Cf" for char in text)


def split_text(text: str, max_chars: int) -> list[str]:
    """`text` as segments of at most `max_chars` characters each, cut at the strongest break available."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    text = text.strip()
    if len(text) <= max_chars:
        return [] if is_empty_text(text) else [text]
    return _pack(_cut(text, "", max_chars, (_SENTENCE_END, _CLAUSE_END, _SPACE)), max_chars)


def _cut(text: str, before: str, max_chars: int, breaks: tuple[re.Pattern, ...]) -> list[tuple[str, str]]:
    """Pieces of at most max_chars, each with what the text had before it (`before` for the first): whitespace,
    maybe none, and any piece between that would be empty text as a segment. Cut at the first kind of break, and
    any piece still too long at the next kind, down to fixed-width slices."""
    if len(text) <= max_chars:
        return [(text, before)]
    if not breaks:
        return _slices(text, before, max_chars)
    pieces, start, separator = [], 0, before
    for cut in breaks[0].finditer(text):
        closing = cut.group().rstrip()   # the closing marks the break pattern took stay with their sentence
        pieces.append((text[start:cut.start()] + closing, separator))
        start, separator = cut.end(), cut.group()[len(closing):]
    pieces.append((text[start:], separator))
    parts, gap = [], ""
    for piece, sep in pieces:
        if is_empty_text(piece):   # as a segment it would be empty text: it is part of the gap before the next
            gap += sep + piece
        else:
            parts += _cut(piece.strip(), gap + sep, max_chars, breaks[1:])
            gap = ""
    return parts


def _slices(text: str, before: str, max_chars: int) -> list[tuple[str, str]]:
    """text in slices of at most max_chars, each with the whitespace before it (`before` for the first), none
    starting with a combining mark, a joiner or a modifier (one after a joiner: an emoji sequence) where the
    slice before can end earlier. A slice the manifest would call empty text (no-break spaces, which no break
    pattern cuts at, or zero-width characters, alone) joins the separator of the next one instead."""
    slices, start, separator = [], 0, before
    while start < len(text):
        end = min(start + max_chars, len(text))
        cut = end
        while start + 1 < cut < len(text) and (_JOINS_BACK.match(text, cut) or text[cut - 1] == "\u200d"):
            cut -= 1
        end = cut if cut > start + 1 else end
        if not is_empty_text(text[start:end]):
            slices.append((text[start:end], separator))
            separator = ""
        else:
            separator += text[start:end]
        start = end
    return slices


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

