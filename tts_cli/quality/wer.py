"""Word error rate the Seed-TTS-eval way, the corpus summary, and the runaway flags.

Normalization (Seed-TTS-eval run_wer.py): delete every character of Python's string.punctuation
and of the CJK punctuation set (zhon.hanzi.punctuation) except the ASCII apostrophe, collapse
whitespace, lowercase; Chinese text is split into space-separated characters, so its "WER" is a
character error rate; on rows heard as Chinese (zh, yue), Traditional characters are made Simplified
in the text and the hypothesis (zhconv, the script only; Seed-TTS-eval converts its hypotheses to
zh-cn, which also swaps words), so that a script variant is not an error. No number or abbreviation
normalization: "4" against "four" is an error.
Reported score: the mean of the per-row WERs; the corpus WER (all errors over all reference words),
the count of rows above 50% and the mean of the other rows are reported beside it.
"""
from __future__ import annotations

import re
import statistics
import string
import unicodedata
from dataclasses import dataclass

import jiwer
import zhconv

# zhon.hanzi.punctuation (zhon 2.x), written out so as not to depend on zhon.
CJK_PUNCTUATION = ("＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､\u3000、〃〈〉《》「」『』【】〔〕〖〗〘〙〚〛"
                   "〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏﹑﹔·！？｡。")
DELETED_CHARACTERS = set(string.punctuation + CJK_PUNCTUATION) - {"'"}
# Before deleting: typographic apostrophes are the ASCII one (whisper writes "don't" for "don’t"), and
# the marks that stand between words (dashes, ellipses) a space, so that "hello—world" stays two words.
# Seed-TTS-eval's texts are ASCII; without this a curly apostrophe cost a word, a dash joined two.
TYPOGRAPHIC = str.maketrans({"‘": "'", "’": "'", "‛": "'", "‒": " ", "–": " ", "—": " ", "―": " ", "…": " "})
HIGH_WER = 0.5
SLOW_FACTOR = 3.0           # seconds per character above this multiple of the corpus median
# Speech runs at ~14 Latin letters a second (tts bench's lengths) but ~4-5 Chinese characters and ~6-7
# Korean syllables: one rate for a mixed corpus counts each such character as three letters.
WIDE_CHARACTER_WEIGHT = 3
NEAR_SILENT_RMS = 1e-3      # -60 dBFS: below any speech, above dither
_SPACES = re.compile(r"\s+")
PROTOCOL = (
    "Seed-TTS-eval: delete every character of string.punctuation and of the CJK punctuation set "
    "(zhon.hanzi.punctuation) except the ASCII apostrophe (curly apostrophes become it, dashes and ellipses a "
    "space, first); collapse whitespace; lowercase; Chinese and Japanese text is split into characters (a "
    "CER); rows heard as Chinese (zh, yue): Traditional characters made Simplified (zhconv zh-hans) in text and "
    "hypothesis; no number normalization. WER per row = (substitutions + deletions + "
    "insertions) / reference words (jiwer). Score = mean of per-row WERs; corpus WER = all errors / all "
    "reference words; rows above 50% are counted and the mean of the other rows is given beside it."
)
FLAG_MEANINGS = {
    "hit_cap": "stopped at its frame cap, not at end of speech",
    "slow": f"audio seconds per text character above {SLOW_FACTOR:g}x the corpus median (runaway or long pauses)",
    "silent": f"empty or near-silent audio (RMS below {NEAR_SILENT_RMS:g})",
    "wer_above_50": f"WER above {HIGH_WER:.0%}",
}


def has_unspaced_script(text: str) -> bool:
    """Han or kana in the text: scripts written without spaces between words, scored per character
    whatever language the ASR detected (a Japanese sentence is otherwise one word)."""
    return any("\u3040" <= c <= "\u30ff" or "\u3400" <= c <= "\u9fff" for c in text)


def normalize(text: str, split_characters: bool = False, simplified: bool = False) -> str:
    """Seed-TTS-eval normalization; split_characters for Chinese (one token per character);
    simplified: Traditional Chinese characters made Simplified."""
    kept = "".join(c for c in text.translate(TYPOGRAPHIC) if c not in DELETED_CHARACTERS).lower()
    if simplified:   # after the punctuation is gone (zhconv makes 『』 curly quotes, kept as apostrophes);
        kept = zhconv.convert(kept, "zh-hans")   # the script only: zh-cn swaps words too (記憶體 -> 内存)
    if split_characters:
        return " ".join(c for c in kept if not c.isspace())
    return " ".join(kept.split())


@dataclass
class RowWer:
    wer: float
    errors: int
    reference_words: int


def row_wer(reference: str, hypothesis: str, split_characters: bool = False, simplified: bool = False) -> RowWer | None:
    """None when the normalized reference has no words (nothing to score against)."""
    ref, hyp = (normalize(text, split_characters, simplified) for text in (reference, hypothesis))
    if not ref:
        return None
    out = jiwer.process_words(ref, hyp)
    errors = out.substitutions + out.deletions + out.insertions
    words = out.substitutions + out.deletions + out.hits
    return RowWer(errors / words, errors, words)


def summarize(scores: list[RowWer]) -> dict:
    """Corpus numbers over the scored rows (None when no row was scored)."""
    if not scores:
        return {"scored_rows": 0, "mean_wer": None, "corpus_wer": None, "rows_above_50": 0,
                "mean_wer_of_rows_at_or_below_50": None}
    at_or_below = [s.wer for s in scores if s.wer <= HIGH_WER]
    return {
        "scored_rows": len(scores),
        "mean_wer": statistics.fmean(s.wer for s in scores),
        "corpus_wer": sum(s.errors for s in scores) / sum(s.reference_words for s in scores),
        "rows_above_50": len(scores) - len(at_or_below),
        "mean_wer_of_rows_at_or_below_50": statistics.fmean(at_or_below) if at_or_below else None,
    }


def spoken_length(text: str) -> int:
    """A text's characters but spaces, a wide letter (a Chinese or Japanese character, a Korean syllable;
    not wide punctuation or emoji) as WIDE_CHARACTER_WEIGHT: each takes about that many Latin letters'
    time to say."""
    return sum(WIDE_CHARACTER_WEIGHT if unicodedata.east_asian_width(char) in "WF"
               and unicodedata.category(char).startswith("L") else 1 for char in _SPACES.sub("", text))


def slow_rows(seconds: list[float | None], texts: list[str]) -> list[bool]:
    """Rows whose audio seconds per text character (spoken_length) exceed SLOW_FACTOR x the median of
    the rows with audio."""
    per_char = [None if s is None else s / max(1, spoken_length(t)) for s, t in zip(seconds, texts)]
    known = [v for v in per_char if v is not None and v > 0]
    if not known:
        return [False] * len(texts)
    limit = SLOW_FACTOR * statistics.median(known)
    return [v is not None and v > limit for v in per_char]

