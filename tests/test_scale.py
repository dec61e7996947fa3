"""Scale-out: --shard i/n partitions, --gpus worker processes (as CPU workers), the Ray Data path."""
import gc
import importlib.util
import io
import json
import queue
import re
import signal
import sys
import threading
import time
import types
import weakref
from contextlib import contextmanager
from multiprocessing import Pipe
from pathlib import Path

import numpy as np

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf
import torch
from typer.testing import CliRunner

from tts_cli import cli
from tts_cli.checkpoint import open_checkpoint
from tts_cli.errors import TTSError
from tts_cli.scale.shard import parse_shard, shard_of
from tts_cli.scale.workers import parse_devices

from fakes import use_fake_synthesizer

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]
needs_bundled_model = pytest.mark.skipif(not (cli.BUNDLED_MODEL_DIR / "config.json").is_file(),
                                         reason="the bundled model is missing")


def test_shards_of_every_n_are_disjoint_and_cover_all_ids():
    ids = [f"utt-{i}" for i in range(2000)] + ["", "é", "a/b"]
    for n in (1, 2, 3, 8):
        shards = [{row_id for row_id in ids if shard_of(row_id, n) == i} for i in range(n)]
        assert set().union(*shards) == set(ids) and sum(map(len, shards)) == len(ids)
        assert all(len(shard) > len(ids) / n / 2 for shard in shards)   # balanced, roughly
    assert shard_of("utt-7", 8) == shard_of("utt-7", 8) == 0           # fixed: SHA-256, not hash()


@pytest.mark.parametrize("spec", ["3/3", "-1/2", "1", "a/b", "1/0", "1/2/3", "١/٢", "0/٢", "٠/2", "0/²"])
def test_bad_shard_specs_are_refused(spec):
    with pytest.raises(TTSError, match="expected i/n with 0 <= i < n"):
        parse_shard(spec)


def test_good_shard_specs():
    assert parse_shard("0/4") == (0, 4) and parse_shard(" 3 / 4 ") == (3, 4) and parse_shard("09/10") == (9, 10)


def test_gpu_lists():
    assert parse_devices("0,1") == ["cuda:0", "cuda:1"]
    assert parse_devices("cpu, cpu") == ["cpu", "cpu"]
    for spec in ("0,gpu1", "١", "0,²", "cuda:١"):   # (other scripts' digits: int() takes some, torch none)
        with pytest.raises(TTSError, match="expected GPU numbers"):
            parse_devices(spec)


def test_an_empty_gpus_list_is_refused_not_ignored(tmp_path):
    (tmp_path / "m.txt").write_text("One line.\n")
    result = runner.invoke(cli.app, ["synth", str(tmp_path / "m.txt"), "--out", str(tmp_path / "out"), "--gpus", ""])
    assert result.exit_code == 2 and "--gpus '': expected GPU numbers" in result.stderr, result.output
    assert not (tmp_path / "out").exists()


def test_shard_runs_together_make_the_whole_manifest(monkeypatch, tmp_path):
    """Acceptance: the union of --shard i/n over all i is the manifest, pairwise disjoint, bad rows included."""
    use_fake_synthesizer(monkeypatch, tmp_path)
    manifest = tmp_path / "m.txt"
    manifest.write_text("".join(f"row-{i}\tSentence {i}.\n" for i in range(30)) + "bad/id\tText.\n\n")
    seen = []
    for i in range(3):
        out = tmp_path / f"shard-{i}"
        result = runner.invoke(cli.app, ["synth", str(manifest), "--out", str(out), "--model", str(tmp_path / "model"),
                                         "--shard", f"{i}/3"])
        assert result.exit_code in (0, 1), result.output
        report = json.loads((out / "report.json").read_text())
        assert report["settings"]["shard"] == f"{i}/3"
        assert report["totals"]["skipped_empty"] == (1 if i == 0 else 0)   # the manifest's blank line, once
        seen.append([row["id"] for row in report["rows"]])
        assert {p.stem for p in out.glob("*.wav")} == {row["id"] for row in report["rows"] if row["error"] is None}
    all_ids = [f"row-{i}" for i in range(30)] + ["bad/id"]
    assert sorted(sum(seen, [])) == sorted(all_ids)
    assert all(seen) and len(set(sum(seen, []))) == len(all_ids)


@needs_bundled_model
def test_gpus_list_runs_one_worker_process_each(tmp_path, monkeypatch, capfd):
    monkeypatch.delenv("TTS_MODEL", raising=False)
    manifest = tmp_path / "m.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(4)], "text": [f"Sentence {i}." for i in range(4)],
                             "speaker": ["vivian"] * 3 + ["nobody"]}), manifest)
    out = tmp_path / "out"
    result = runner.invoke(cli.app, ["-v", "synth", str(manifest), "--out", str(out), "--gpus", "cpu,cpu",
                                     "--max-frames", "3", "--batch-size", "1", "--greedy"])
    assert result.exit_code == 1, result.output
    # -v reaches the workers: each says which path it took, on the stderr they share with the parent
    assert capfd.readouterr().err.count("tts (cpu): synthesis path: plain model (cpu: ") == 2
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["devices"] == ["cpu", "cpu"]
    assert report["dtype"] == "float32"   # as the workers loaded it
    assert [row["error"] is None for row in report["rows"]] == [True] * 3 + [False]
    assert "unknown speaker 'nobody'" in report["rows"][3]["error"]   # checked in the parent, from config.json
    single = tmp_path / "single"
    assert runner.invoke(cli.app, ["synth", str(manifest), "--out", str(single), "--max-frames", "3",
                                   "--batch-size", "1", "--greedy"]).exit_code == 1
    for row in report["rows"][:3]:
        assert sf.read(out / row["file"])[0].tolist() == sf.read(single / row["file"])[0].tolist()


class _KilledProcess:
    pid, exitcode = 4242, -signal.SIGKILL

    def join(self, timeout=None):
        pass


class _Tasks:
    def put(self, item):
        pass

    def cancel_join_thread(self):
        pass


@pytest.mark.parametrize("cut", ["between messages", "during a message"])
def test_a_worker_killed_while_it_sends_fails_the_rows_it_held(cut):
    """A worker killed between two messages leaves an EOF on its result pipe; one killed while it
    sent a message leaves part of it, and recv raises OSError (seen in CI): either way its rows
    fail with one line that says so, and the run goes on."""
    import os
    import struct
    from multiprocessing.connection import Connection

    from tts_cli.scale.workers import Worker, WorkerPool
    read, write = os.pipe()
    if cut == "during a message":
        os.write(write, struct.pack("!i", 100) + b"part")   # a 100-byte message cut after 4 bytes
    os.close(write)
    pool = object.__new__(WorkerPool)
    pool.workers = [Worker("cpu", _KilledProcess(), _Tasks(), Connection(read, writable=False))]
    pool.notes, pool.started = [], 2
    (index, outcomes, seconds), = list(pool.run([["row a", "row b"]]))
    assert index == 0 and seconds == 0.0 and [position for position, _ in outcomes] == [0, 1]
    assert all(str(error) == "worker on cpu (pid 4242) died (killed by SIGKILL) while it held this row: rerun the "
               "same command to retry it" for _, error in outcomes)
    assert pool.workers == [] and "the run went on with 0 of 2 workers" in pool.notes[0]


class _Process:
    def __init__(self, pid, exitcode=None):
        self.pid, self.exitcode = pid, exitcode

    def join(self, timeout=None):
        pass


def test_the_workers_engine_time_is_summed_for_the_report_with_each_workers_beside_it():
    """--gpus: each worker sends its engine's timing with every batch; the report's `synthesis` block sums
    the workers' latest (per step: the mean over all their steps) and lists each worker's."""
    from multiprocessing import Pipe

    from tts_cli.output.report import _synthesis_lines
    from tts_cli.scale.workers import Worker, WorkerPool
    from tts_cli.synthesizer import SynthesisTiming

    pool = object.__new__(WorkerPool)
    pool.notes, pool.started, pool.timings, pool.workers = [], 2, {}, []
    senders = []   # held open: a closed end would be a dead worker's EOF
    for index, (device, steps) in enumerate([("cuda:0", 100), ("cuda:1", 300)]):
        received, sent = Pipe(duplex=False)
        senders.append(sent)
        timing = SynthesisTiming(calls=1, engine_seconds=steps * 0.02, gpu_wait_seconds=steps * 0.01, steps=steps,
                                 slot_steps=steps * 64, frames=steps * 48, stage_ms={"depth": steps * 5.0},
                                 peak_gpu_bytes=steps * 2**28)
        sent.send(("row", index, 0, "outcome", 1.0))
        sent.send(("done", index, 1.0, [], timing, None))
        pool.workers.append(Worker(device, _Process(11 + index), _Tasks(), received))
    assert [index for index, _, _ in pool.run([["a"], ["b"]])] == [0, 1]
    summed = pool.timing
    assert (summed["calls"], summed["steps"], summed["engine_seconds"]) == (2, 400, 8.0)
    assert summed["gpu_wait_seconds"] == 4.0
    assert (summed["ms_per_step"], summed["gpu_ms_per_step"], summed["slots_busy"]) == (20.0, {"depth": 5.0}, 0.75)
    assert summed["peak_gpu_gib"] == 75.0   # the most of one worker (300 x 2^28 bytes), not their sum
    assert {name: one["steps"] for name, one in summed["per_worker"].items()} == {
        "worker on cuda:0 (pid 11)": 100, "worker on cuda:1 (pid 12)": 300}
    lines = _synthesis_lines(summed)
    assert lines[0].startswith("Engine: summed over 2 workers running at once, 400 steps in 8.00 s (20.00 ms per step")
    assert lines[0].endswith("(2 calls); peak GPU memory 75.0 GiB.") and lines[1].endswith("peak GPU memory 25.0 GiB.")
    assert lines[2].startswith("- worker on cuda:1 (pid 12): 300 steps in 6.00 s")
    pool.timings = {}
    assert pool.timing is None   # CPU workers run the plain path: no block, as in process


def test_a_worker_whose_batch_raises_sends_its_rows_failed_and_ends(monkeypatch):
    """A device fault or a bug: failing every batch at once, the worker would take most of them from
    its healthy peers (it asks for work first), so it ends after the first, and the pool goes on
    without it (tests above: a worker that dies)."""
    import queue
    from multiprocessing import Pipe

    import torch

    from tts_cli import synthesizer
    from tts_cli.request import Request
    from tts_cli.scale import workers

    from fakes import FakeSynthesizer

    monkeypatch.setattr(workers, "end_with_parent", lambda: None)
    monkeypatch.setattr(synthesizer.Synthesizer, "from_pretrained", staticmethod(lambda *a, **k: FakeSynthesizer()))
    tasks, (received, sent) = queue.Queue(), Pipe(duplex=False)
    for index, text in enumerate(["Fine.", "A device fault [bug].", "Never run."]):
        tasks.put((index, [Request(f"r{index}", text, "vivian")]))
    with pytest.raises(SystemExit) as ended:
        workers.worker_main("model", "cpu", torch.get_num_threads(), True, 5, 1, 64, "auto", "fp16", "fp16", False,
                            tasks, sent)
    assert ended.value.code == workers.FAULT_EXIT
    messages = [received.recv() for _ in range(4)]
    assert [m[:2] for m in messages[1:]] == [("row", 0), ("done", 0), ("done", 1)]
    assert str(messages[3][5]) == "on cpu: ValueError: a bug in synthesis (fake)"   # for its rows not sent
    assert messages[2][5] is None   # batch 0 had no fault
    assert messages[2][3] == []   # the synthesizer's notes (--rows auto's choices ...), for the report
    assert messages[2][4] is None   # its timing: none on the plain path (the fake's)
    assert not received.poll() and tasks.qsize() == 1


class _RowByRow:
    """A synthesizer that hands each row to on_result as it ends, as the engine does, keeping a weak reference to
    its audio (made); before_row(k) runs before row k of a call is made, and a row whose text holds "[bug]" raises."""
    notes, sample_rate, numerics = [], 24000, "float32 (the fake's)"

    def __init__(self, before_row=lambda k: None):
        self.before_row, self.made = before_row, []

    def synthesize(self, requests, greedy=False, max_frames=None, max_rows=None, on_result=None, cancel=None):
        for k, request in enumerate(requests):
            self.before_row(k)
            if "[bug]" in request.text:
                raise ValueError("a bug in synthesis (fake)")
            on_result(k, self._result(request))   # (no reference to the row is left here)
        return [None] * len(requests)

    def _result(self, request):
        from tts_cli.request import Result

        audio = np.full(2 * 1920, 0.1, np.float32)
        self.made.append(weakref.ref(audio))
        return Result(request.id, torch.zeros(2, 16, dtype=torch.int64), audio, False)


class _ThreadTasks(queue.Queue):
    def cancel_join_thread(self):
        pass


@contextmanager
def _pool_of_a_worker_thread(monkeypatch, synth, process):
    """A WorkerPool of one worker: worker_main on `synth`, in a thread of this process, seen by the pool as
    `process`; yields (the pool, the worker's end of its result pipe, the exit codes it raised)."""
    from tts_cli import synthesizer
    from tts_cli.scale import workers

    monkeypatch.setattr(workers, "end_with_parent", lambda: None)
    monkeypatch.setattr(synthesizer.Synthesizer, "from_pretrained", staticmethod(lambda *a, **k: synth))
    tasks, (received, sent), exits = _ThreadTasks(), Pipe(duplex=False), []

    def worker():
        try:
            workers.worker_main("model", "cpu", torch.get_num_threads(), True, 5, 8, 64, "auto", "fp16", "fp16", False,
                                tasks, sent)
        except SystemExit as e:
            exits.append(e.code)
        finally:
            sent.close()   # as a process's end closes its pipe

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    assert received.recv()[0] == "ready"
    pool = object.__new__(workers.WorkerPool)
    pool.cfg = open_checkpoint(cli.BUNDLED_MODEL_DIR).config   # the rows are checked against it
    pool.voices, pool.notes, pool.timings, pool.started = None, [], {}, 1
    pool.sample_rate, pool.numerics = synth.sample_rate, synth.numerics
    pool.workers = [workers.Worker("cpu", process, tasks, received)]
    try:
        yield pool, sent, exits
    finally:
        tasks.put(None)
        thread.join(10)


def _requests(*texts):
    from tts_cli.request import Request

    return [Request(f"r{k}", text, "vivian") for k, text in enumerate(texts)]


@needs_bundled_model
def test_a_workers_rows_reach_the_parent_as_they_end_not_when_its_batch_does(monkeypatch):
    """A batch of 16 x 1024 segments runs for minutes: its rows are written as they end, as in process, so that a
    kill loses only the rows in flight."""
    first_row_seen = threading.Event()

    def before_row(k):
        if k == 1:
            assert first_row_seen.wait(5), "row 0 did not reach the parent before row 1 was made"

    seen = []
    with _pool_of_a_worker_thread(monkeypatch, _RowByRow(before_row), _Process(11)) as (pool, _, _):
        for index, outcomes, seconds in pool.run([_requests("One.", "Two.")]):
            seen += [(index, position, type(outcome).__name__) for position, outcome in outcomes]
            if seen:
                first_row_seen.set()
    assert seen == [(0, 0, "Segment"), (0, 1, "Segment")]


@needs_bundled_model
def test_a_worker_keeps_no_row_it_has_sent(monkeypatch):
    """The parent has a row: nothing of the worker holds its audio any more (as tests/test_pipeline.py checks in
    process), so that its host memory follows the rows in flight, not its batch."""
    has = [threading.Event() for _ in range(4)]
    alive = []   # at each row: the rows made before it whose audio the worker still holds

    def before_row(k):
        if k > 0:
            assert has[k - 1].wait(5), f"the parent did not get row {k - 1} before row {k} was made"
        deadline = time.monotonic() + 5   # (the sender lets go of a message just after the parent has it)
        while any(ref() is not None for ref in synth.made) and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.01)
        alive.append([row for row, ref in enumerate(synth.made) if ref() is not None])

    synth = _RowByRow(before_row)
    with _pool_of_a_worker_thread(monkeypatch, synth, _Process(11)) as (pool, _, _):
        for index, outcomes, seconds in pool.run([_requests("One.", "Two.", "Three.", "Four.")]):
            for position, outcome in outcomes:
                assert outcome.audio.shape == (2 * 1920,)
                has[position].set()
    assert alive == [[], [], [], []]


@needs_bundled_model
def test_a_device_fault_mid_batch_keeps_the_rows_sent_before_it(monkeypatch):
    """A device fault or a bug ends the worker: the rows of its batch not sent yet fail with it, those it sent are
    the parent's already."""
    from tts_cli.scale.workers import FAULT_EXIT

    with _pool_of_a_worker_thread(monkeypatch, _RowByRow(), _Process(11, FAULT_EXIT)) as (pool, _, exits):
        outcomes = [(index, position, str(outcome) if isinstance(outcome, TTSError) else type(outcome).__name__)
                    for index, batch, _ in pool.run([_requests("One.", "A device fault [bug].", "Three."),
                                                     _requests("Never run.")])
                    for position, outcome in batch]
    assert exits == [FAULT_EXIT]
    fault = "on cpu: ValueError: a bug in synthesis (fake)"
    died = ("worker on cpu (pid 11) died (ended itself after a device fault or a bug, which its last batch's rows "
            "name)")
    assert outcomes == [(0, 0, "Segment"), (0, 1, fault), (0, 2, fault),
                        (1, 0, f"{died} while it held this row: rerun the same command to retry it")]
    assert pool.notes == [f"{died} holding 1 batches (1 segments not sent yet): their rows failed, the run went on "
                          "with 0 of 1 workers; rerun the same command to retry them"]


@needs_bundled_model
def test_a_worker_that_dies_mid_batch_keeps_the_rows_it_sent_and_fails_only_the_rest(monkeypatch, tmp_path):
    """Rows r0 and r1 of batch 0 are written and recorded; the worker dies making r2 (its pipe closes): r2 and the
    batch it held after (r3) fail, r0 and r1 keep their one ledger line and file."""
    from tts_cli.job import JobSettings, run_job
    from tts_cli.manifest import ManifestRow

    recorded, seen = threading.Event(), set()

    def before_row(k):
        if k == 2 and not sent.closed:   # making r2: it dies once r0 and r1 are recorded
            assert recorded.wait(5), "rows r0 and r1 were not recorded before the batch ended"
            sent.close()

    def rows_done(records):
        seen.update(record.request.id for record in records)
        if {"r0", "r1"} <= seen:
            recorded.set()

    rows = [ManifestRow(k, request) for k, request in enumerate(_requests("One.", "Two.", "Three.", "Four."))]
    with _pool_of_a_worker_thread(monkeypatch, _RowByRow(before_row), _KilledProcess()) as (pool, sent, _):
        result = run_job(rows, {k: f"r{k}.wav" for k in range(4)}, tmp_path, JobSettings(batch_size=3),
                         lambda: pool, on_rows_done=rows_done)
    ledger = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    died = "worker on cpu (pid 4242) died (killed by SIGKILL)"
    assert [(entry["id"], entry["error"]) for entry in ledger] == [
        ("r0", None), ("r1", None),
        ("r2", f"{died} while it held this row: rerun the same command to retry it"),
        ("r3", f"{died} while it held this row: rerun the same command to retry it")]
    assert sorted(path.name for path in tmp_path.glob("*.wav")) == ["r0.wav", "r1.wav"]
    assert f"{died} holding 2 batches (2 segments not sent yet): their rows failed" in " ".join(result.notes)


needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the [ray] extra is not installed "
                               "(pip install -e '.[ray]'); make test installs it")


def _synthesize_with_local_ray(manifest: Path, out: Path, **options) -> dict[str, dict]:
    """synthesize_with_ray on a local Ray of 2 CPUs; the output rows by id (a row failed as a repeated id: id*,
    whichever shard, in whatever order, holds it)."""
    import ray

    from tts_cli.scale.ray_data import synthesize_with_ray

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}   # ray.init replaces them
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}})
    try:
        synthesize_with_ray(manifest, out, actors=1, **options)
    finally:
        ray.shutdown()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    table = pa.concat_tables([pq.read_table(p) for p in sorted(out.glob("*.parquet"))])
    return {row["id"] + ("*" if (row["error"] or "").startswith("duplicate id") else ""): row
            for row in table.to_pylist()}


@needs_bundled_model
@needs_ray
def test_ray_data_path_in_local_mode(tmp_path):
    """Also: a row without an id is named by its row number; a duplicate id in another batch fails its row; ids that
    sanitize alike keep paths apart; a base seed near the top of 64 bits wraps (it overflowed)."""
    manifest = tmp_path / "m.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c", "a", None, "x y", "x_y"],
                             "text": ["Hello there.", "Second row.", "", "Again.", "No id.", "Spaced.", "Joined."],
                             "seed": [1, None, None, None, None, None, None]}), manifest)
    rows = _synthesize_with_local_ray(manifest, tmp_path / "out", model_dir=cli.BUNDLED_MODEL_DIR, max_frames=3,
                                      greedy=True, base_seed=2**63 - 10, rows_per_batch=2)
    assert sorted(rows) == ["000005", "a", "a*", "b", "c", "x y", "x_y"]
    for row_id in ("a", "b"):
        audio, rate = sf.read(io.BytesIO(rows[row_id]["audio"]["bytes"]))
        assert rate == 24000 and len(audio) == rows[row_id]["frames"] * 1920 > 0 and rows[row_id]["error"] is None
    assert rows["c"]["error"] == "empty text" and rows["c"]["audio"] is None
    assert rows["a*"]["error"] == "duplicate id 'a' (first used by row 1)"   # in another batch
    assert rows["000005"]["error"] is None and rows["000005"]["audio"]["path"] == "000005.flac"
    assert rows["x_y"]["audio"]["path"] == "x_y.flac" and rows["x y"]["audio"]["path"].startswith("x_y-")


@needs_bundled_model
@needs_ray
def test_the_ray_path_clones_voices_as_tts_synth_does(tmp_path):
    """ICL and x-vector rows of a Base checkpoint (the reference relative to the manifest): the same
    audio as `tts synth` makes; a missing reference fails its row with the reason."""
    base = REPO / "tests" / "fixtures" / "tiny-1.7b-base"
    (tmp_path / "refs").mkdir()
    (tmp_path / "refs" / "voice.wav").write_bytes((REPO / "tests" / "fixtures" / "reference-voice-24k.wav").read_bytes())
    manifest = tmp_path / "clones.parquet"
    pq.write_table(pa.table({
        "id": ["icl", "xvec", "missing"], "text": ["In a cloned voice.", "From its x-vector.", "Nowhere."],
        "ref_audio": ["refs/voice.wav", "refs/voice.wav", "refs/nowhere.wav"],
        "ref_text": ["The reference says this.", None, None], "x_vector_only": [False, True, True],
        "seed": [1, 2, 3]}), manifest)
    rows = _synthesize_with_local_ray(manifest, tmp_path / "ray", model_dir=base, max_frames=3)
    result = runner.invoke(cli.app, ["synth", str(manifest), "--out", str(tmp_path / "synth"), "--model", str(base),
                                     "--max-frames", "3", "--no-wer", "--format", "flac"])   # the Ray path's FLAC
    assert result.exit_code == 1, result.output   # the missing reference's row
    for row_id in ("icl", "xvec"):
        assert rows[row_id]["error"] is None
        ray_audio, _ = sf.read(io.BytesIO(rows[row_id]["audio"]["bytes"]), dtype="int16")
        synth_audio, _ = sf.read(tmp_path / "synth" / f"{row_id}.flac", dtype="int16")
        assert len(ray_audio) > 0 and (ray_audio == synth_audio).all()
    assert rows["missing"]["audio"] is None and "nowhere.wav" in rows["missing"]["error"]


@needs_bundled_model
@needs_ray
def test_the_ray_path_names_rows_without_an_id_by_their_row_number_across_batches(tmp_path):
    """Rows were numbered within their Ray batch: those without an id in two batches were both '000001' (and
    failed); a manifest without an id column was refused. Now each is named by its row in the manifest, as tts synth
    names it, whichever batch it lands in."""
    manifest = tmp_path / "m.parquet"
    pq.write_table(pa.table({"id": [None, "b", None, " ", "e"], "text": ["One.", "Two.", "Three.", "Four.", "Five."]}),
                   manifest)
    rows = _synthesize_with_local_ray(manifest, tmp_path / "out", model_dir=cli.BUNDLED_MODEL_DIR, max_frames=1,
                                      greedy=True, rows_per_batch=2)
    assert sorted(rows) == ["000001", "000003", "000004", "b", "e"]
    assert [rows[row_id]["error"] for row_id in sorted(rows)] == [None] * 5
    assert rows["000003"]["text"] == "Three." and rows["000003"]["audio"]["path"] == "000003.flac"
    pq.write_table(pa.table({"text": ["One.", "Two.", "Three."]}), manifest)
    rows = _synthesize_with_local_ray(manifest, tmp_path / "no-id-column", model_dir=cli.BUNDLED_MODEL_DIR,
                                      max_frames=1, greedy=True, rows_per_batch=2)
    assert {row_id: row["text"] for row_id, row in rows.items()} == {"000001": "One.", "000002": "Two.",
                                                                     "000003": "Three."}


BASE_MODEL = REPO / "tests" / "fixtures" / "tiny-1.7b-base"


@needs_bundled_model
@pytest.mark.parametrize("model, arguments, message", [
    (BASE_MODEL, {"ref_text": "Some words."}, "ref_text: given without ref_audio, whose option it is (the transcript "
                                              "of that file); a manifest row with a reference of its own takes its own "
                                              "ref_text column"),
    (BASE_MODEL, {"x_vector_only": True}, "x_vector_only: given without ref_audio, whose option it is"),
    (BASE_MODEL, {"ref_audio": "me.wav"}, "ref_audio: ICL voice cloning (x_vector_only false) needs ref_text, the "
                                          "reference's transcript"),
    (BASE_MODEL, {"ref_audio": "missing.wav", "x_vector_only": True}, "ref_audio: reference file not found: "),
    (BASE_MODEL, {"ref_audio": "m.parquet", "x_vector_only": True}, "is not audio that libsndfile reads"),
    (BASE_MODEL, {"speaker": "vivian", "ref_audio": "me.wav", "x_vector_only": True},
     "speaker: speaker 'vivian': a Base checkpoint has no named speakers"),
    (BASE_MODEL, {"language": "klingon", "ref_audio": "me.wav", "x_vector_only": True},
     "language: unknown language 'klingon'"),
    (cli.BUNDLED_MODEL_DIR, {"ref_audio": "me.wav", "x_vector_only": True},
     "ref_audio: this checkpoint (custom_voice) cannot clone a voice"),
])
def test_the_ray_path_refuses_voice_arguments_before_it_reads_the_manifest(tmp_path, monkeypatch, model, arguments,
                                                                           message):
    """The Ray path runs tts synth's check of its voice options (tests/test_voice_job.py), naming its keyword
    arguments: a value the checkpoint cannot take stops it before a row is read, instead of failing every
    row once the actors have loaded the model. Ray stands in here by an empty module, and the manifest's reader
    refuses to read."""
    from tts_cli.scale.ray_data import synthesize_with_ray

    def read_table(*args, **kwargs):
        raise AssertionError("the manifest was read: the voice arguments were not checked first")

    ray_data = types.ModuleType("ray.data")
    ray = types.ModuleType("ray")
    ray.data = ray_data
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.data", ray_data)
    monkeypatch.chdir(tmp_path)
    sf.write(tmp_path / "me.wav", [0.3, -0.3] * 15000, 24000, subtype="PCM_16")
    pq.write_table(pa.table({"id": ["a"], "text": ["One line to speak."]}), tmp_path / "m.parquet")
    monkeypatch.setattr(pq, "read_table", read_table)
    with pytest.raises(TTSError) as refused:
        synthesize_with_ray(tmp_path / "m.parquet", tmp_path / "out", model_dir=model, **arguments)
    assert message in str(refused.value)


def _recording_ray(monkeypatch, table: pa.Table) -> dict:
    """Ray, stood in by a module that records what it is given instead of running, and the manifest's reader by
    one that reads `table`: the path read ("read"), the blocks ("blocks"), the actors' constructor arguments (and
    "make_actor", which makes one with them), and the path written ("write")."""
    seen = {}

    class Dataset:
        def map_batches(self, actor, fn_constructor_kwargs, **options):
            seen.update(fn_constructor_kwargs, make_actor=lambda: actor(**fn_constructor_kwargs))
            return types.SimpleNamespace(write_parquet=lambda path: seen.update(write=path))

    monkeypatch.setattr(pq, "read_table", lambda path: seen.update(read=path) or table)
    ray_data = types.ModuleType("ray.data")
    ray_data.from_arrow = lambda blocks: seen.update(blocks=blocks) or Dataset()
    ray_data.ActorPoolStrategy = lambda size: None
    ray = types.ModuleType("ray")
    ray.data = ray_data
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.data", ray_data)
    return seen


@needs_bundled_model
def test_the_ray_path_gives_ray_and_its_actors_absolute_paths(tmp_path, monkeypatch):
    """Ray's tasks and the actors run in a working folder of their own (a runtime_env working_dir, another
    node's): a relative manifest was not found, a relative model_dir failed every actor, and a relative
    out_dir's shards went to their folder, leaving out_dir empty. URIs are pyarrow's and Ray's to read as they are."""
    import os

    from tts_cli.scale.ray_data import synthesize_with_ray

    seen = _recording_ray(monkeypatch, pa.table({"id": ["a"], "text": ["One line to speak."]}))
    monkeypatch.chdir(tmp_path)
    synthesize_with_ray("m.parquet", "out", model_dir=os.path.relpath(cli.BUNDLED_MODEL_DIR))
    assert (seen["read"], seen["write"]) == (str(tmp_path / "m.parquet"), str(tmp_path / "out"))
    assert (seen["model_dir"], seen["references_base"]) == (str(cli.BUNDLED_MODEL_DIR), str(tmp_path))
    synthesize_with_ray("s3://bucket/m.parquet", f"file://{tmp_path}/uri", model_dir=cli.BUNDLED_MODEL_DIR)
    assert (seen["read"], seen["write"]) == ("s3://bucket/m.parquet", f"file://{tmp_path}/uri")


@needs_bundled_model
@pytest.mark.parametrize("name", ["actors", "rows_per_batch", "segments_per_call", "segment_chars", "max_text_chars",
                                  "max_frames"])
def test_the_ray_path_refuses_counts_below_one_before_it_reads_the_manifest(tmp_path, monkeypatch, name):
    """tts synth's options of the same names take 1 or more; the actors took a 0 once they had loaded the model:
    every row failed (segments_per_call, segment_chars), or was made of no audio (max_frames)."""
    from tts_cli.scale.ray_data import synthesize_with_ray

    seen = _recording_ray(monkeypatch, pa.table({"id": ["a"], "text": ["One line to speak."]}))
    with pytest.raises(TTSError, match=f"^{name}: expected 1 or more, got 0$"):
        synthesize_with_ray(tmp_path / "m.parquet", tmp_path / "out", model_dir=cli.BUNDLED_MODEL_DIR, **{name: 0})
    assert "read" not in seen


@needs_bundled_model
def test_the_ray_path_refuses_an_output_folder_that_holds_files(tmp_path, monkeypatch):
    """A second run into the same folder added its shards beside the first's: read as one dataset, every row twice.
    An empty folder is fresh."""
    from tts_cli.scale.ray_data import synthesize_with_ray

    seen = _recording_ray(monkeypatch, pa.table({"id": ["a"], "text": ["One line to speak."]}))
    (tmp_path / "out").mkdir()
    synthesize_with_ray(tmp_path / "m.parquet", tmp_path / "out", model_dir=cli.BUNDLED_MODEL_DIR)
    assert seen.pop("write") == str(tmp_path / "out")
    (tmp_path / "out" / "shard-0.parquet").write_bytes(b"")
    (tmp_path / "out" / "shard-1.parquet").write_bytes(b"")
    with pytest.raises(TTSError, match=r"out holds shard-\d.parquet and 1 more: the Ray path does not resume"):
        synthesize_with_ray(tmp_path / "m.parquet", tmp_path / "out", model_dir=cli.BUNDLED_MODEL_DIR)
    assert "write" not in seen
    with pytest.raises(TTSError, match="cannot use .*shard-0.parquet as the output folder: .*Not a directory"):
        synthesize_with_ray(tmp_path / "m.parquet", tmp_path / "out" / "shard-0.parquet",
                            model_dir=cli.BUNDLED_MODEL_DIR)


@needs_bundled_model
def test_the_ray_path_refuses_a_manifest_without_rows(tmp_path, monkeypatch):
    """tts synth exits 2 on such a manifest; the Ray path returned as if done, having written nothing."""
    from tts_cli.scale.ray_data import synthesize_with_ray

    seen = _recording_ray(monkeypatch, pa.table({"id": pa.array([], pa.string()), "text": pa.array([], pa.string())}))
    with pytest.raises(TTSError, match=f"^{re.escape(str(tmp_path / 'm.parquet'))}: no rows$"):
        synthesize_with_ray(tmp_path / "m.parquet", tmp_path / "out", model_dir=cli.BUNDLED_MODEL_DIR)
    assert "write" not in seen


@needs_bundled_model
def test_the_ray_path_refuses_a_seed_that_is_not_an_integer_naming_its_row_as_tts_synth_does(tmp_path, monkeypatch):
    """A seed of 1.5 failed its row in its Ray batch, with "column 'seed': expected an integer, got 1.5", not naming the
    row, while tts synth refuses the manifest naming it. The Ray path now refuses it with tts synth's message before
    Ray reads a row."""
    from tts_cli.manifest import RowDefaults, read_manifest
    from tts_cli.scale.ray_data import synthesize_with_ray

    table = pa.table({"id": ["a", "b", "c"], "text": ["One.", "Two.", "Three."], "seed": [1.0, None, 1.5]})
    pq.write_table(table, tmp_path / "m.parquet")
    seen = _recording_ray(monkeypatch, table)
    with pytest.raises(TTSError) as refused:
        synthesize_with_ray(tmp_path / "m.parquet", tmp_path / "out", model_dir=cli.BUNDLED_MODEL_DIR, rows_per_batch=2)
    with pytest.raises(TTSError) as refused_by_synth:
        read_manifest(tmp_path / "m.parquet", RowDefaults("vivian", "auto", 0))
    assert str(refused.value) == str(refused_by_synth.value) == (
        f"{tmp_path / 'm.parquet'}: column 'seed', row 3: expected an integer, got 1.5")
    assert "blocks" not in seen and "write" not in seen


@needs_bundled_model
def test_the_ray_path_names_max_text_chars_as_its_caller_set_it(tmp_path, monkeypatch):
    """A text over the limit failed with "(--max-text-chars)", an option the Python API does not have. The rows are
    made here as the actors make them, from the arguments Ray would give them."""
    from tts_cli.manifest import rows_from_table
    from tts_cli.scale.ray_data import synthesize_with_ray

    table = pa.table({"id": ["long", "short"], "text": ["Eleven char", "Ten chars."]})
    actor_arguments = _recording_ray(monkeypatch, table)
    synthesize_with_ray(tmp_path / "m.parquet", tmp_path / "out", model_dir=cli.BUNDLED_MODEL_DIR, max_text_chars=10)
    rows = rows_from_table(table, actor_arguments["defaults"], "a Ray batch")
    assert [row.problem for row in rows] == ["text is 11 characters, over the limit of 10 (max_text_chars)", None]


def test_the_ray_path_fails_a_relative_ref_audio_of_a_remote_manifest(tmp_path, monkeypatch):
    """A relative ref_audio starts from the manifest's folder: for s3://bucket/data/m.parquet that was the local path
    s3:/bucket/data under the working folder, and for a file:// manifest file:/..., where no reference is. The actors
    read local reference files only: such a row fails, saying so, while an absolute path still names a local file,
    and a file:// manifest's folder is local. The rows are made here as the actors make them; nothing is read from
    the network (the manifest's reader stands in)."""
    from tts_cli.manifest import rows_from_table
    from tts_cli.scale.ray_data import synthesize_with_ray

    table = pa.table({"id": ["relative", "absolute"], "text": ["One.", "Two."],
                      "ref_audio": ["refs/v.wav", str(tmp_path / "v.wav")], "x_vector_only": [True, True]})
    actor_arguments = _recording_ray(monkeypatch, table)
    synthesize_with_ray("s3://bucket/data/m.parquet", tmp_path / "out", model_dir=BASE_MODEL)
    assert actor_arguments["references_base"] is None
    relative, absolute = rows_from_table(table, actor_arguments["defaults"], "a Ray batch", base_dir=None)
    assert relative.problem == ("ref_audio 'refs/v.wav' is relative to a remote manifest (a URI): tts reads reference "
                                "files from local paths only; give an absolute path that every actor can read")
    assert absolute.problem is None and absolute.request.ref_audio == str(tmp_path / "v.wav")
    synthesize_with_ray(f"file://{tmp_path}/data/m.parquet", tmp_path / "out", model_dir=BASE_MODEL)
    assert actor_arguments["references_base"] == str(tmp_path / "data")


@needs_bundled_model
def test_the_ray_path_takes_a_blank_ref_audio_for_none_as_tts_synth_does(tmp_path, monkeypatch):
    """ref_audio="  " passed the voice check as no reference, then was resolved to the working folder, which every
    row without a reference of its own took for its reference, and failed. The rows are made here as the actors
    make them, from the arguments Ray would give them; Ray stands in by a module that records those."""
    from tts_cli.manifest import RowDefaults, check_references, read_manifest, rows_from_table
    from tts_cli.scale.ray_data import synthesize_with_ray

    table = pa.table({"id": ["a"], "text": ["One line to speak."]})
    actor_arguments = _recording_ray(monkeypatch, table)
    monkeypatch.chdir(tmp_path)
    pq.write_table(table, tmp_path / "m.parquet")
    synthesize_with_ray(tmp_path / "m.parquet", tmp_path / "out", model_dir=cli.BUNDLED_MODEL_DIR, ref_audio="  ")
    [row] = rows_from_table(table, actor_arguments["defaults"], "a Ray batch",
                            base_dir=Path(actor_arguments["references_base"]))
    check_references([row])
    [local_row] = read_manifest(tmp_path / "m.parquet", RowDefaults("vivian", "auto", 0, ref_audio="  ")).rows
    assert row.problem is local_row.problem is None
    assert row.request.ref_audio is local_row.request.ref_audio is None


def _ray_actor_on_blocks(monkeypatch, tmp_path, table: pa.Table, **options) -> tuple[list[dict], list]:
    """synthesize_with_ray with Ray stood in (_recording_ray): an actor made as Ray makes it, on a fake synthesizer,
    called on each block as Ray calls it. Its output rows, and the plans it synthesized (their rows)."""
    from tts_cli import job, synthesizer
    from tts_cli.scale.ray_data import synthesize_with_ray

    from fakes import FakeSynthesizer

    seen = _recording_ray(monkeypatch, table)
    synthesize_with_ray(tmp_path / "m.parquet", tmp_path / "out", model_dir=cli.BUNDLED_MODEL_DIR, **options)
    monkeypatch.setattr(synthesizer.Synthesizer, "from_pretrained", staticmethod(lambda *a, **k: FakeSynthesizer()))
    plans, synthesize_plans = [], job.synthesize_plans
    monkeypatch.setattr(job, "synthesize_plans", lambda batch_plans, *args: plans.extend(batch_plans)
                        or synthesize_plans(batch_plans, *args))
    actor = seen["make_actor"]()
    return [row for block in seen["blocks"] for row in actor(block).to_pylist()], plans


@needs_bundled_model
def test_the_ray_path_seeds_rows_by_their_row_in_the_manifest_as_tts_synth_does(tmp_path, monkeypatch):
    """A row without a seed drew with base_seed + a hash of its id, not base_seed + its row index as in tts synth:
    the same manifest made other audio through Ray. Each row now takes tts synth's seed, whichever batch it is in."""
    from tts_cli.manifest import RowDefaults, read_manifest

    table = pa.table({"id": ["a", None, "c", "d", "e"], "text": ["One.", "Two.", "Three.", "Four.", "Five."],
                      "seed": [None, None, 7, None, None]})
    pq.write_table(table, tmp_path / "m.parquet")
    rows, plans = _ray_actor_on_blocks(monkeypatch, tmp_path, table, rows_per_batch=2, base_seed=100)
    assert [row["error"] for row in rows] == [None] * 5
    local = read_manifest(tmp_path / "m.parquet", RowDefaults("vivian", "auto", 100)).rows
    assert [(plan.row.number, plan.row.request.id, plan.row.request.seed) for plan in plans] == [
        (row.number, row.request.id, row.request.seed) for row in local] == [
        (1, "a", 100), (2, "000002", 101), (3, "c", 7), (4, "d", 103), (5, "e", 104)]


@needs_bundled_model
def test_the_ray_path_finds_duplicate_ids_across_batches_as_tts_synth_does(tmp_path, monkeypatch):
    """Duplicate ids were found only within a Ray batch: one in another batch made a second row of that id (and output
    name). The first row with an id keeps it, and later ones fail naming it, whichever batch each is in."""
    from tts_cli.manifest import RowDefaults, read_manifest

    table = pa.table({"id": ["a", None, "b", "a", "000002"], "text": ["One.", "Two.", "Three.", "Four.", "Five."]})
    pq.write_table(table, tmp_path / "m.parquet")
    rows, _ = _ray_actor_on_blocks(monkeypatch, tmp_path, table, rows_per_batch=2)
    local = read_manifest(tmp_path / "m.parquet", RowDefaults("vivian", "auto", 0)).rows
    assert [row["error"] for row in rows] == [row.problem for row in local] == [
        None, None, None, "duplicate id 'a' (first used by row 1)",
        "duplicate id '000002' (first used by row 2; a row without an id of its own is named by its number)"]
    assert [row["audio"] is None for row in rows] == [False, False, False, True, True]
