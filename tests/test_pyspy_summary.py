"""tools/pyspy_summary.py over a small raw py-spy profile (collapsed stacks with thread heads):
samples per thread, self and inclusive shares, and errors that name the bad line."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from pyspy_summary import frame_key, parse, summary  # noqa: E402

PROFILE = "\n".join([
    "thread (0x1): tts-synthesis;run (tts_cli/engine/runner.py:340);_drain (tts_cli/engine/runner.py:491);"
    "_wait (tts_cli/engine/runner.py:610);synchronize (torch/cuda/streams.py:225) 60",
    "thread (0x1);run (tts_cli/engine/runner.py:340);_drain (tts_cli/engine/runner.py:500) 20",
    "thread (0x1);run (tts_cli/engine/runner.py:340);_drain (tts_cli/engine/runner.py:491) 10",
    "thread (0x1);run (tts_cli/engine/runner.py:355);_end (tts_cli/engine/runner.py:570) 10",
    "thread (0x2): tts-writer_0;store (tts_cli/output/formats.py:40);write (soundfile.py:363) 20",
    "thread (0x2): tts-writer_0 5",
])


def test_samples_per_thread_and_their_names_from_any_line():
    threads = parse(PROFILE)
    assert {t.tid: (t.name, t.samples) for t in threads.values()} == {"0x1": ("tts-synthesis", 100),
                                                                      "0x2": ("tts-writer_0", 25)}
    engine = threads["0x1"]
    assert engine.self_frames["synchronize (torch/cuda/streams.py)"] == 60
    assert engine.self_frames["_drain (tts_cli/engine/runner.py)"] == 30   # lines 491 and 500 are one function
    assert engine.inclusive["_drain (tts_cli/engine/runner.py)"] == 90
    assert engine.inclusive["run (tts_cli/engine/runner.py)"] == 100      # counted once per sample
    assert threads["0x2"].self_frames["(no Python frame)"] == 5


def test_summary_lists_threads_by_samples_with_their_shares():
    text = summary(parse(PROFILE), top=2, matches=["tts_cli/"])
    lines = [line.strip() for line in text.splitlines()]
    assert lines[:4] == ["thread tts-synthesis (0x1): 100 samples, 80.0% of all", "self:",
                         "60.0%  synchronize (torch/cuda/streams.py)", "30.0%  _drain (tts_cli/engine/runner.py)"]
    assert "10.0%  _end (tts_cli/engine/runner.py)" not in lines   # beyond --top 2
    assert lines[4:7] == ["inclusive (tts_cli/):", "100.0%  run (tts_cli/engine/runner.py)",
                          "90.0%  _drain (tts_cli/engine/runner.py)"]
    # the two lines of _drain apart; _end's line (10 samples too, seen later) beyond --top 2
    assert lines[7:10] == ["self, by line (tts_cli/):", "20.0%  _drain (tts_cli/engine/runner.py:500)",
                           "10.0%  _drain (tts_cli/engine/runner.py:491)"]
    assert lines[10:] == ["thread tts-writer_0 (0x2): 25 samples, 20.0% of all", "self:",
                          "80.0%  write (soundfile.py)", "20.0%  (no Python frame)",
                          "inclusive (tts_cli/):", "80.0%  store (tts_cli/output/formats.py)"]


def test_a_line_without_a_count_or_a_thread_is_refused_by_number():
    with pytest.raises(ValueError, match="line 2 is not 'stack count'"):
        parse("thread (0x1): main;f (a.py:1) 3\nthread (0x1): main;f (a.py:1)")
    with pytest.raises(ValueError, match="line 1 does not start with a thread"):
        parse("f (a.py:1);g (a.py:2) 3")
    assert frame_key("<module> (<frozen site>:616)") == "<module> (<frozen site>)"
