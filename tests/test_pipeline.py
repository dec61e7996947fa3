"""Synthesis beside writing: `tts synth` writes each row as the engine ends it, while the rest is
still being synthesized (tts_cli/job.py LocalExecutor), and a stopped run ends the engine at a
window boundary, leaving it ready for another run."""
import gc
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest

from tts_cli.errors import SynthesisCancelled
from tts_cli.job import JobSettings, LocalExecutor, RowLimit, Segment, run_job, synthesize_batch
from tts_cli.manifest import RowDefaults, read_manifest
from tts_cli.request import Request
from tts_cli.synthesizer import Synthesizer

from fakes import FakeSynthesizer

TINY = Path(__file__).resolve().parents[1] / "tts_cli" / "assets" / "tiny-1.7b-customvoice"


class StreamingFake(FakeSynthesizer):
    """Ends the first row of a call, then waits until that row's file is written before it ends the
    others: a job that writes only after the call returns never lets it go on."""

    def __init__(self, written: threading.Event):
        super().__init__()
        self.written, self.waited = written, []

    def synthesize(self, requests, greedy=False, max_frames=None, max_rows=None, on_result=None, cancel=None):
        results = super().synthesize(requests, greedy, max_frames, max_rows)
        on_result(0, results[0])
        self.waited.append(self.written.wait(timeout=20))
        for i, result in enumerate(results[1:], 1):
            on_result(i, result)
        return results


def test_a_finished_row_is_written_while_its_call_still_synthesizes(tmp_path):
    manifest = tmp_path / "m.txt"
    manifest.write_text("a\tOne.\nb\tTwo.\nc\tThree.\n")
    rows = read_manifest(manifest, RowDefaults(speaker="vivian", language="english", base_seed=0)).rows
    (tmp_path / "out").mkdir()
    written = threading.Event()
    fake = StreamingFake(written)

    def on_output(record, audio, sample_rate):
        if record.request.id == "a":
            assert (tmp_path / "out" / "a.wav").is_file()
            written.set()

    result = run_job(rows, {row.index: f"{row.request.id}.wav" for row in rows}, tmp_path / "out",
                     JobSettings(batch_size=8), lambda: LocalExecutor(fake, JobSettings(batch_size=8)),
                     on_output=on_output)
    assert fake.waited == [True]
    assert fake.batches == [["a", "b", "c"]]
    assert [r.error for r in result.records] == [None, None, None]
    assert all((tmp_path / "out" / f"{name}.wav").is_file() for name in "abc")


def test_a_row_handed_on_is_kept_by_nothing_of_its_call():
    """A call holds up to 16 x slots segments on cuda: once on_outcome has a row, its audio lives as
    long as on_outcome's consumer keeps it, not until the call ends; one that keeps them has them all."""
    synth = Synthesizer.from_pretrained(TINY, engine=True, engine_rows=1)   # rows end one by one
    requests = [Request(id=str(i), text=t, speaker="vivian", seed=i)
                for i, t in enumerate(["Hi.", "The birch canoe slid on the smooth planks.", "Glue the sheet."])]
    kept = {}
    synthesize_batch(synth, requests, greedy=False, max_frames=9, limit=RowLimit(8), on_outcome=kept.__setitem__)
    delivered, alive_at_delivery = {}, []

    def on_outcome(position, outcome):
        gc.collect()
        alive_at_delivery.append([position for position, (ref, _) in delivered.items() if ref() is not None])
        delivered[position] = (weakref.ref(outcome.audio), outcome.audio.copy())

    synthesize_batch(synth, requests, greedy=False, max_frames=9, limit=RowLimit(8), on_outcome=on_outcome)
    assert alive_at_delivery == [[], [], []]
    gc.collect()
    assert sorted(delivered) == [0, 1, 2] and all(ref() is None for ref, _ in delivered.values())
    assert sorted(kept) == [0, 1, 2] and all(isinstance(o, Segment) and o.frames > 0 for o in kept.values())
    for position, (_, audio) in delivered.items():
        assert np.array_equal(audio, kept[position].audio)


def test_a_cancelled_engine_run_stops_at_a_window_and_the_engine_runs_again_the_same():
    synth = Synthesizer.from_pretrained(TINY, engine=True, engine_rows=2)
    requests = [Request(id=str(i), text=t, speaker="vivian", seed=i)
                for i, t in enumerate(["Hi.", "The birch canoe slid on the smooth planks.", "Glue the sheet."])]
    fresh = Synthesizer.from_pretrained(TINY, engine=True, engine_rows=2).synthesize(requests, max_frames=9,
                                                                                      min_new_tokens=10)
    cancel, ended = threading.Event(), []

    def on_result(index, result):
        ended.append(index)
        cancel.set()

    with pytest.raises(SynthesisCancelled):
        synth.synthesize(requests, max_frames=9, min_new_tokens=10, on_result=on_result, cancel=cancel)
    assert len(ended) < len(requests)   # the third request was never admitted
    again = synth.synthesize(requests, max_frames=9, min_new_tokens=10)
    for a, b in zip(fresh, again):
        assert np.array_equal(a.codes.numpy(), b.codes.numpy()) and np.array_equal(a.audio, b.audio)


def test_a_cancelled_plain_batch_stops_before_its_next_frame():
    """A stop on the CPU path does not wait for the lockstep batch's last frame (minutes at the real
    shapes): the frame loop looks at the event."""
    synth = Synthesizer.from_pretrained(TINY)
    requests = [Request(id=str(i), text="The birch canoe slid on the smooth planks.", speaker="vivian")
                for i in range(2)]
    cancel, frames = threading.Event(), []
    original = synth.model.talker.forward

    def forward(*args, **kwargs):   # the talker runs once for the prompt, then once per frame
        frames.append(1)
        if len(frames) == 3:
            cancel.set()
        return original(*args, **kwargs)

    synth.model.talker.forward = forward
    with pytest.raises(SynthesisCancelled):
        synth.synthesize(requests, max_frames=50, min_new_tokens=51, cancel=cancel)
    assert len(frames) == 3


def test_the_report_says_where_the_engine_spent_its_time(tmp_path):
    from tts_cli.output.report import RunInfo, build_report, render_markdown

    manifest = tmp_path / "m.txt"
    manifest.write_text("a\tOne.\nb\tThe birch canoe slid on the smooth planks.\nc\tGlue the sheet.\n")
    rows = read_manifest(manifest, RowDefaults(speaker="vivian", language="english", base_seed=0)).rows
    (tmp_path / "out").mkdir()
    synth = Synthesizer.from_pretrained(TINY, engine=True, engine_rows=2)
    settings = JobSettings(batch_size=8, max_frames=6)
    result = run_job(rows, {row.index: f"{row.request.id}.wav" for row in rows}, tmp_path / "out", settings,
                     lambda: LocalExecutor(synth, settings))
    timing = result.synthesis
    frames = sum(record.frames for record in result.records)
    assert timing["calls"] == 1 and timing["steps"] >= 6
    assert timing["slots_busy"] == round(frames / (timing["steps"] * 2), 3)
    assert timing["engine_seconds"] > 0 and timing["engine_build_seconds"] > 0
    assert timing["prompt_seconds"] >= 0   # tokenizing three short rows: under the 1 ms it is rounded to
    assert timing["gpu_ms_per_step"] == {}   # CUDA events only on a GPU
    assert timing["gpu_wait_seconds"] == 0   # on CPU the engine's work is done when its call returns
    assert 0 <= timing["row_callback_seconds"] < timing["engine_seconds"]   # (its count: tests/test_engine.py)
    assert 0 <= timing["prompt_vector_seconds"] < timing["engine_seconds"]   # (its count: tests/test_engine.py)
    assert 0 <= timing["pcm_copy_seconds"] < timing["engine_seconds"]    # (its count: tests/test_engine.py)
    info = RunInfo(manifest="m.txt", model_dir="tiny", model_source="--model", bundled_random_model=True,
                   device="cpu", dtype="float32", greedy=False, base_seed=0, max_frames=6, batch_size=8,
                   skipped_empty=0, load_seconds=0.0, wall_seconds=result.wall_seconds, tts_version="test",
                   synthesis=timing)
    report = build_report(info, result.records)
    assert report["synthesis"] == timing and "synthesis" in report["definitions"]
    assert f"Engine: {timing['steps']} steps in" in render_markdown(report)
    assert (f"handed rows over in {timing['row_callback_seconds']:.2f} s, built prompt vectors in "
            f"{timing['prompt_vector_seconds']:.2f} s and copied audio in {timing['pcm_copy_seconds']:.2f} s"
            ) in render_markdown(report)
