"""`--gpus 0,1,...`: one worker process per device of this host, each with its own synthesizer.

The parent plans the run, writes every output and the ledger; workers only synthesize. Each worker
has its own task queue and its own result pipe: the parent keeps up to two batches in flight per
worker (one running, one waiting, so that no worker idles between batches) and hands the next
batch to whichever worker answers, so a slow device never holds up the others. Workers are started
with `spawn` (CUDA cannot be forked) and end with the parent, also when it is SIGKILLed
(tts_cli/processes.py), since only the parent writes files.

A worker sends each row as it ends, then a message that closes the batch ("row", "done" below), and
the parent hands the rows on to be written as they come, as in process: a batch of 16 x 1024 segments
runs for minutes, and neither the worker nor the parent holds its rows until it ends.

A worker that dies (killed, out of host memory, a crashed driver) closes its result pipe: the
parent sees the EOF at once, fails the rows of the batches that worker held and had not sent (the
run's exit status is then 1, and a rerun retries them; those it sent are written as any other) and
goes on with the other workers; with none left, the run stops. Private pipes and queues keep a
killed worker from taking a lock that the others need. On a stop signal no batch is sent any more,
the workers are ended (as a SIGTERM to the process group ends them: else their rows would go on
coming), and the rows they sent before are read (and so written by the job), without waiting for
those still being made.
`cpu` entries make CPU workers (`--gpus cpu,cpu`), which is how the pool is tested without GPUs.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING, Iterator

from ..errors import TTSError
from ..logs import log_to_stderr, verbose
from ..processes import STOP_POLL_SECONDS, RunCannotGoOn, end_with_parent, stop_signal
from ..recipe import ascii_whole_number
from ..request import Request

if TYPE_CHECKING:
    from ..job import Outcome, Outcomes
    from ..synthesizer import SynthesisTiming

BATCHES_IN_FLIGHT_PER_WORKER = 2   # one running, one waiting: no idle gap between batches
STOP_SECONDS = 10                  # a worker told to stop that is still there after this is killed
FAULT_EXIT = 3                     # a worker that ended itself after an unexpected error in a batch
GATHER_SECONDS = 0.25              # the longest the parent reads rows that keep coming before it hands them on


def parse_devices(spec: str) -> list[str]:
    """'0,1' -> ['cuda:0', 'cuda:1']; 'cpu,cpu' -> two CPU workers; 'cuda:2' is kept as it is."""
    devices = []
    for part in (p.strip() for p in spec.split(",")):
        if ascii_whole_number(part) is not None:
            devices.append(f"cuda:{part}")
        elif part == "cpu" or (part.startswith("cuda:") and ascii_whole_number(part[5:]) is not None):
            devices.append(part)
        else:
            raise TTSError(f"--gpus {spec!r}: expected GPU numbers separated by commas (0,1,2), or cpu entries")
    return devices


def check_devices(devices: list[str]) -> None:
    import torch

    count = torch.cuda.device_count()
    for device in devices:
        if device.startswith("cuda:") and int(device[5:]) >= count:
            raise TTSError(f"--gpus: {device} is not there (torch sees {count} CUDA devices)")


# What reading a worker's result pipe raises once the worker is gone: EOFError between messages, and
# OSError ("got end of file during message") when it died while sending one (seen in CI: SIGKILL).
ENDED = (EOFError, OSError)


@dataclass
class Worker:
    device: str
    process: multiprocessing.Process
    tasks: multiprocessing.Queue    # (batch index, requests), or None: stop
    results: Connection             # what the worker sends; EOF once it has ended
    # batches sent to it and not done yet -> the positions of their rows it sent
    held: dict[int, set[int]] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"worker on {self.device} (pid {self.process.pid})"


class WorkerPool:
    """The Executor of tts_cli/job.py over worker processes."""

    def __init__(self, model_dir: Path, devices: list[str], settings, voices=None):
        from ..checkpoint import open_checkpoint

        self.cfg = open_checkpoint(model_dir).config   # rows are checked here, without loading weights
        # References are encoded here, in the parent, before any batch goes out (tts_cli/job.py
        # prepare_request): each once, into one cache, and the batches carry them to the workers.
        self.voices = voices
        self.notes: list[str] = []                     # one line per worker that died; their synthesizers' notes
        self.timings: dict[str, SynthesisTiming] = {}   # each worker's engine time, as of its last batch
        context = multiprocessing.get_context("spawn")
        cpu_threads = max(1, (os.cpu_count() or 1) // len(devices))
        self.workers: list[Worker] = []              # those alive
        self.started = len(devices)
        try:
            for device in devices:
                tasks = context.Queue()
                results, worker_end = context.Pipe(duplex=False)
                process = context.Process(target=worker_main, daemon=True, name=f"tts-worker-{device}", args=(
                    str(model_dir), device, cpu_threads, settings.greedy, settings.max_frames, settings.batch_size,
                    settings.engine_rows, settings.depth, settings.codec_precision, settings.talker_precision,
                    verbose(), tasks, worker_end))
                process.start()
                worker_end.close()   # the worker holds the only other copy: its end is an EOF here
                self.workers.append(Worker(device, process, tasks, results))
            ready = [self._ready(worker) for worker in self.workers]
        except BaseException:
            self.close(now=True)
            raise
        self.sample_rate = ready[0][0]
        self.numerics = "; ".join(sorted({numerics for _, numerics in ready}))   # the same model on every device

    def prepare(self, request: Request) -> Request:
        from ..job import prepare_request
        from ..synthesizer import Synthesizer

        # Synthesizer.validate reads only .cfg, which the pool has too
        return prepare_request(request, self.voices, lambda r: Synthesizer.validate(self, r))

    def _ready(self, worker: Worker) -> tuple:
        try:
            message = worker.results.recv()
        except ENDED:
            raise TTSError(f"{worker} died while loading the model ({_how_it_ended(worker.process)})") from None
        if message[0] == "failed":
            raise TTSError(f"worker on {message[1]} could not load the model: {message[2]}")
        return message[2]

    def run(self, batches: list[list[Request]]) -> Iterator[Outcomes]:
        from ..job import NO_OUTCOMES, outcomes_by_batch

        unsent, done = deque(range(len(batches))), 0
        while done < len(batches):
            stopping = stop_signal() is not None
            if stopping:   # a worker would go on sending rows: only those it sent before it ended are read
                for worker in self.workers:
                    worker.process.terminate()
            elif not self.workers:
                raise RunCannotGoOn(f"every worker process died ({self.started} of {self.started}; the notes "
                                    "say how)")
            while unsent and not stopping:   # to the least busy worker first
                worker = min(self.workers, key=lambda w: len(w.held))
                if len(worker.held) == BATCHES_IN_FLIGHT_PER_WORKER:
                    break
                index = unsent.popleft()
                worker.held[index] = set()
                worker.tasks.put((index, batches[index]))
            # a message, or the EOF of a worker that died; after a stop only what has come already
            ready = wait([w.results for w in self.workers], timeout=0 if stopping else STOP_POLL_SECONDS)
            if not ready:
                if stopping:
                    return
                yield NO_OUTCOMES
                continue
            arrived: list[tuple[int, int, Outcome, float]] = []   # (batch index, position, outcome, seconds)
            done += self._receive(ready, batches, arrived)
            yield from outcomes_by_batch(arrived)

    def _receive(self, ready: list, batches: list[list[Request]], arrived: list) -> int:
        """Reads the ready workers' messages, and those that come meanwhile (for up to GATHER_SECONDS: the rows
        that end together are written together), into arrived; how many batches ended (done, or lost with
        their worker)."""
        done, until = 0, perf_counter() + GATHER_SECONDS
        while ready:
            for worker in [w for w in self.workers if w.results in ready]:
                done += self._receive_one(worker, batches, arrived)
            if perf_counter() > until:
                break
            ready = wait([w.results for w in self.workers], timeout=0)
        return done

    def _receive_one(self, worker: Worker, batches: list[list[Request]], arrived: list) -> int:
        """Reads a message of the worker, or its EOF, into arrived; how many batches it ended. Messages:
        ("row", batch index, position, outcome, seconds since the batch started), once per row as it ends;
        ("done", batch index, seconds, the synthesizer's notes, its timing, fault) after the batch's last row,
        fault: the TTSError of a device fault or a bug for the rows not sent, after which the worker ends."""
        try:
            message = worker.results.recv()
        except ENDED:
            # Ended by the stop too (a SIGTERM to the whole process group, or the pool's): its rows not sent
            # are left not synthesized, not failed.
            if stop_signal() is not None:
                self._remove(worker)
                return 0
            arrived += self._lost(worker, batches)
            return len(worker.held)
        if message[0] == "row":
            _, index, position, outcome, seconds = message
            worker.held[index].add(position)
            arrived.append((index, position, outcome, seconds))
            return 0
        _, index, seconds, notes, timing, fault = message
        if fault is not None:   # (the worker ends after it)
            arrived += [(index, position, fault, seconds) for position in _not_sent(worker, index, batches)]
        del worker.held[index]
        self.notes += [note for note in notes if note not in self.notes]   # its synthesizer's, as in process
        if timing is not None:
            self.timings[str(worker)] = timing
        return 1

    @property
    def timing(self) -> dict | None:
        """The workers' engine time (tts_cli/synthesizer.py SynthesisTiming) summed, each worker's in
        per_worker; None when no worker ran an engine (CPU workers run the plain path)."""
        from ..synthesizer import SynthesisTiming

        ran = {name: timing for name, timing in self.timings.items() if timing.calls}
        if not ran:
            return None
        return {**SynthesisTiming.merged(ran.values()).as_dict(),
                "per_worker": {name: timing.as_dict() for name, timing in ran.items()}}

    def _lost(self, worker: Worker, batches: list[list[Request]]) -> list[tuple[int, int, TTSError, float]]:
        """A worker that died: the rows of its batches that it did not send fail with one line that says so
        (batch index, position, error, seconds)."""
        how = self._remove(worker)
        left = [(index, position) for index in worker.held for position in _not_sent(worker, index, batches)]
        self.notes.append(f"{worker} died ({how}) holding {len(worker.held)} batches ({len(left)} segments not sent "
                          f"yet): their rows failed, the run went on with {len(self.workers)} of {self.started} "
                          "workers; rerun the same command to retry them")
        error = TTSError(f"{worker} died ({how}) while it held this row: rerun the same command to retry it")
        return [(index, position, error, 0.0) for index, position in left]

    def _remove(self, worker: Worker) -> str:
        """Takes a worker that ended out of the pool; how it ended."""
        self.workers.remove(worker)
        worker.tasks.cancel_join_thread()   # what it did not take is dropped, not waited for at exit
        return _how_it_ended(worker.process)

    def close(self, now: bool = False) -> None:
        """Stops the workers: after their batches, or now (a stopped or failed run), by SIGTERM."""
        for worker in self.workers:
            if now:
                worker.tasks.cancel_join_thread()
                worker.process.terminate()
            else:
                worker.tasks.put(None)
        for worker in self.workers:
            worker.process.join(timeout=STOP_SECONDS)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.results.close()
        self.workers = []


def _not_sent(worker: Worker, index: int, batches: list[list[Request]]) -> list[int]:
    """The positions of a batch's rows the worker has not sent."""
    return [position for position in range(len(batches[index])) if position not in worker.held[index]]


def _how_it_ended(process: multiprocessing.Process) -> str:
    process.join(timeout=STOP_SECONDS)   # the pipe's EOF can come just before the exit status
    code = process.exitcode
    if code is None:
        return "its result pipe closed"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    if code == FAULT_EXIT:
        return "ended itself after a device fault or a bug, which its last batch's rows name"
    return f"exit code {code}"


def timing_now(synth) -> SynthesisTiming | None:
    """A copy of the synthesizer's timing so far (the sender thread pickles it while the next batch runs)."""
    timing = getattr(synth, "timing", None)
    return None if timing is None else replace(timing, stage_ms=dict(timing.stage_ms))


def worker_main(model_dir: str, device: str, cpu_threads: int, greedy: bool, max_frames: int | None,
                batch_size: int, engine_rows: int, depth: str, codec_precision: str, talker_precision: str,
                verbose_log: bool, tasks, results: Connection) -> None:
    end_with_parent()
    import torch

    from ..job import RowLimit, synthesize_batch
    from ..synthesizer import Synthesizer, allow_tf32

    log_to_stderr(verbose_log, prefix=f"tts ({device})")
    if device == "cpu":
        torch.set_num_threads(cpu_threads)
    else:
        allow_tf32()
    try:
        synth = Synthesizer.from_pretrained(model_dir, device=device, engine_rows=engine_rows, depth=depth,
                                            codec_precision=codec_precision, talker_precision=talker_precision)
    except Exception as e:  # reported to the parent, which stops the run with it
        results.send(("failed", device, f"{type(e).__name__}: {e}"))
        return
    results.send(("ready", device, (synth.sample_rate, synth.numerics)))
    limit = RowLimit(batch_size)
    # Each row is sent as it ends, by this thread while synthesis goes on, whenever the parent reads: nothing
    # here keeps a row once it is sent (a call of 16 x 1024 segments of 8 s would hold 12.6 GB until its end).
    # One message a row: a message of many rows takes twice as long per row to pickle and pass through the pipe.
    with ThreadPoolExecutor(1, thread_name_prefix="tts-worker-send") as sender:
        while (task := tasks.get()) is not None:
            index, requests = task
            start = perf_counter()

            def send_row(position: int, outcome) -> None:
                sender.submit(results.send, ("row", index, position, outcome, perf_counter() - start))

            fault = None
            try:
                synthesize_batch(synth, requests, greedy, max_frames, limit, on_outcome=send_row)
            except Exception as e:
                # A device fault or a bug: this batch's rows not sent yet fail with it, and the worker ends (a
                # device after a fault is not to be trusted; failing at once, it would take most batches).
                fault = TTSError(f"on {device}: {type(e).__name__}: {e}")
            sender.submit(results.send, ("done", index, perf_counter() - start, list(synth.notes), timing_now(synth),
                                         fault))
            if fault is not None:
                break
        else:
            return
    raise SystemExit(FAULT_EXIT)   # (after the sender has sent the failed batch)
