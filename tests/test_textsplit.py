"""Long text -> segments at sentence and clause boundaries, and the crossfade join."""
import numpy as np
import pytest

from tts_cli.manifest import text_problem
from tts_cli.textsplit import join_with_crossfade, split_text


def _words(text):
    return text.split()


def test_short_text_is_one_segment():
    assert split_text("  Hello there.  ", 50) == ["Hello there."]
    assert split_text("   ", 50) == []


def test_cuts_at_sentence_ends_and_packs_sentences_up_to_the_limit():
    text = "One two three. Four five six! Seven eight? Nine ten."
    assert split_text(text, 30) == ["One two three. Four five six!", "Seven eight? Nine ten."]
    assert split_text(text, 15) == ["One two three.", "Four five six!", "Seven eight?", "Nine ten."]


def test_a_sentence_too_long_is_cut_at_clauses_then_spaces_then_inside_words():
    assert split_text("alpha beta, gamma delta; epsilon zeta.", 20) == ["alpha beta,", "gamma delta;", "epsilon zeta."]
    assert split_text("aaaa bbbb cccc dddd", 9) == ["aaaa bbbb", "cccc dddd"]
    assert split_text("x" * 25, 10) == ["x" * 10, "x" * 10, "x" * 5]


def test_cjk_sentence_and_clause_marks_need_no_space():
    assert split_text("你好世界。今天天气很好！我们走吧，好吗？", 8) == ["你好世界。", "今天天气很好！", "我们走吧，好吗？"]


def test_cjk_text_is_cut_without_adding_spaces_and_closing_marks_stay_with_their_sentence():
    text = "彼は「行きましょう。」と言った。" * 12 + "次。 最後！！」"
    segments = split_text(text, 40)
    assert "".join(segments) == text and all(len(s) <= 40 for s in segments)
    assert not any(s[0] in "」。！" for s in segments) and segments[-1].endswith("最後！！」")
    assert split_text("一。 二。", 2) == ["一。", "二。"] and split_text("一。 二。", 5) == ["一。 二。"]
    assert split_text("No\u00a0break here", 9) == ["No\u00a0break", "here"]


def test_closing_quotes_stay_with_their_sentence():
    assert split_text('He said "stop." Then he left.', 20) == ['He said "stop."', "Then he left."]


def test_ascii_and_half_width_marks_in_cjk_text_are_breaks_without_a_space():
    text = "今天天气很好,我们一起去公园散步吧!你觉得怎么样?我觉得这个主意非常好."
    assert split_text(text * 10, 300)[0] == text * 8   # at a sentence's end, not 300 characters in
    assert split_text("一二三。四五六｡七八九．十", 4) == ["一二三。", "四五六｡", "七八九．", "十"]
    assert split_text("一二三,四五六､七", 4) == ["一二三,", "四五六､", "七"]
    assert split_text("pi is 3.14 or so", 10) == ["pi is 3.14", "or so"]


def test_a_chinese_opening_quote_goes_with_the_sentence_it_opens():
    text = "他说：“你好。”然后他走了。“再见！”她说。" * 3
    segments = split_text(text, 20)
    assert "".join(segments) == text and not any(s.endswith("“") for s in segments)


def test_german_and_french_quotes_close_their_sentence():
    first = "„" + "Wir gehen heute Abend in die Stadt " * 3 + "zusammen.“"
    second = "Sie nickte und " + "lief langsam durch den Park nach Hause " * 3 + "zurück."
    assert split_text(f"{first} {second}", 200) == [first, second]
    assert split_text("«\u00a0Bonjour.\u00a0» Il est parti. «\u00a0Où\u00a0?\u00a0» demanda-t-elle.", 20) == [
        "«\u00a0Bonjour.\u00a0»", "Il est parti.", "«\u00a0Où\u00a0?\u00a0»", "demanda-t-elle."]


def test_a_line_break_ends_a_sentence():
    lines = [f"Chapter {i} the long road home" for i in range(1, 15)]
    assert split_text("\n".join(lines), 100) == ["\n".join(lines[i:i + 3]) for i in range(0, 14, 3)]


def test_a_cut_inside_a_word_keeps_combining_marks_and_joined_emoji_whole():
    assert split_text("e\u0301" * 8, 5) == ["e\u0301e\u0301"] * 4
    family = "\U0001f468\u200d\U0001f469\u200d\U0001f467"   # 5 characters
    assert split_text(family * 3, 7) == [family] * 3
    assert "".join(split_text(family, 4)) == family   # no room for it whole: cut all the same


@pytest.mark.parametrize("limit", [1, 2, 3, 7])
def test_a_run_of_no_break_spaces_longer_than_the_limit_is_no_segment_of_its_own(limit):
    """No-break spaces are never a break: a run of them met by fixed-width slices would be a segment
    of whitespace alone, which fails its row as empty text. It stays between the words around it."""
    text = "word\u00a0" * 100 + "end" + "\u00a0" * 9 + "end"
    segments = split_text(text, limit)
    assert all(segment.strip() and len(segment) <= limit for segment in segments)
    assert "".join(segments).replace("\u00a0", "") == text.replace("\u00a0", "")
    assert split_text("ab" + "\u00a0" * 6 + "cd", 2) == ["ab", "cd"]


@pytest.mark.parametrize("limit", [1, 2, 3, 7])
def test_no_segment_is_text_the_manifest_calls_empty(limit):
    """Zero-width characters pass the synthesizer's check for empty text, not the manifest's: a segment of them
    alone (with no-break spaces or not) is no segment; they stay between the characters around them."""
    invisible = "\u200b\u2060\u00a0\ufeff"
    text = "word\u200b" * 40 + "ab" + invisible * 3 + "cd\n\u200b\nHi.\u200b \u200b Bye."
    segments = split_text(text, limit)
    assert all(text_problem(segment, limit) is None for segment in segments)
    assert "".join(segments).translate(dict.fromkeys(map(ord, invisible + " \n"))) == \
        text.translate(dict.fromkeys(map(ord, invisible + " \n")))
    assert split_text("ab\u200b\u200b\u200bcd", 1) == ["a", "b", "c", "d"]
    assert split_text("ab\u200b\u200b\u200bcd", 3) == ["ab\u200b", "\u200b\u200bc", "d"]
    assert split_text("Hi.\n\u200b\nBye.", 4) == ["Hi.", "Bye."] and split_text("\u200b\u200d", 5) == []


@pytest.mark.parametrize("limit", [7, 40, 300])
def test_segments_respect_the_limit_and_keep_every_word(limit):
    rng = np.random.default_rng(limit)
    words = ["".join(rng.choice(list("abcdefgh"), rng.integers(1, 12))) + str(rng.choice(["", ",", ".", "!", ";"]))
             for _ in range(400)]
    text = " ".join(words)
    segments = split_text(text, limit)
    assert all(0 < len(s) <= limit for s in segments)
    if limit >= 12:   # no word is longer than that, so none is cut inside
        assert _words(" ".join(segments)) == _words(text)
    else:
        assert "".join(segments).replace(" ", "") == text.replace(" ", "")


def test_join_overlaps_each_seam_and_fades_linearly():
    a, b, c = np.ones(100, np.float32), np.full(50, 3.0, np.float32), np.ones(5, np.float32)
    joined = join_with_crossfade([a, b, c], 10)
    assert len(joined) == 100 + 50 + 5 - 10 - 5        # the last seam is as long as the shorter segment
    seam = joined[90:100]
    assert np.all(np.diff(seam) > 0) and 1.0 < seam[0] < seam[-1] < 3.0
    assert np.all(joined[:90] == 1.0) and np.all(joined[100:135] == 3.0)
    assert len(join_with_crossfade([], 10)) == 0
    assert np.array_equal(join_with_crossfade([a], 10), a)
