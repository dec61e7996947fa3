"""`--gpus 0,1,...`: one worker process per device of this host, each with its own synthesizer.

The parent plans the run, writes every output and the ledger; workers only synthesize. Batches go
to whichever worker is free, a few at a time, so a slow device never holds up the others and
the queues stay small whatever the manifest's size. Workers are started with `spawn` (CUDA cannot
be forked) and stop by themselves when the parent dies, since only the parent writes files.
`cpu` entries make CPU workers (`--gpus cpu,cpu`), which is how the pool is tested without GPUs.
"""
from __future__ import annotations

import multiprocessing
import os
import queue
from pathlib import Path
from time import perf_counter
from typing import Iterator

from ..errors import TTSError
from ..logs import log_to_stderr, verbose
from ..request import Request

POLL_SECONDS = 1.0
BATCHES_IN_FLIGHT_PER_WORKER = 2   # one running, one waiting: no idle gap between batches


def parse_devices(spec: str) -> list[str]:
    """'0,1' -> ['cuda:0', 'cuda:1']; 'cpu,cpu' -> two CPU workers; 'cuda:2' is kept as it is."""
    devices = []
    for part in (p.strip() for p in spec.split(",")):
        if part.isdigit():
            devices.append(f"cuda:{part}")
        elif part == "cpu" or (part.startswith("cuda:") and part[5:].isdigit()):
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


class WorkerPool:
    """The Executor of tts_cli/job.py over worker processes."""

    def __init__(self, model_dir: Path, devices: list[str], settings, voices=None):
        from ..checkpoint import open_checkpoint

        self.cfg = open_checkpoint(model_dir).config   # rows are checked here, without loading weights
        # References are encoded here, in the parent, before any batch goes out (tts_cli/job.py
        # prepare_request): each once, into one cache, and the batches carry them to the workers.
        self.voices = voices
        context = multiprocessing.get_context("spawn")
        self.tasks, self.results = context.Queue(), context.Queue()
        cpu_threads = max(1, (os.cpu_count() or 1) // len(devices))
        self.processes = [
            context.Process(target=worker_main, daemon=True, name=f"tts-worker-{device}", args=(
                str(model_dir), device, cpu_threads, settings.greedy, settings.max_frames, settings.batch_size,
                settings.engine_rows, settings.depth, settings.codec_precision, settings.talker_precision,
                verbose(), os.getpid(), self.tasks,
                self.results))
            for device in devices]
        for process in self.processes:
            process.start()
        ready = [self._next_message("ready")[2] for _ in self.processes]
        self.sample_rate = ready[0][0]
        self.numerics = "; ".join(sorted({numerics for _, numerics in ready}))   # the same model on every device

    def prepare(self, request: Request) -> Request:
        from ..job import prepare_request
        from ..synthesizer import Synthesizer

        # Synthesizer.validate reads only .cfg, which the pool has too
        return prepare_request(request, self.voices, lambda r: Synthesizer.validate(self, r))

    def run(self, batches: list[list[Request]]) -> Iterator[tuple[int, list, float]]:
        sent, received = 0, 0
        while received < len(batches):
            while sent < len(batches) and sent - received < BATCHES_IN_FLIGHT_PER_WORKER * len(self.processes):
                self.tasks.put((sent, batches[sent]))
                sent += 1
            _, index, outcomes, seconds = self._next_message("done")
            received += 1
            yield index, outcomes, seconds

    def _next_message(self, kind: str) -> tuple:
        while True:
            try:
                message = self.results.get(timeout=POLL_SECONDS)
            except queue.Empty:
                dead = [p for p in self.processes if not p.is_alive()]
                if dead:
                    raise TTSError(f"worker {dead[0].name} died (exit code {dead[0].exitcode}); rows finished "
                                   "so far are in the ledger: rerun the same command to resume") from None
                continue
            if message[0] == "failed":
                raise TTSError(f"worker on {message[1]} could not load the model: {message[2]}")
            if message[0] != kind:
                raise RuntimeError(f"worker sent {message[0]!r} while {kind!r} was expected")
            return message

    def close(self) -> None:
        for _ in self.processes:
            self.tasks.put(None)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


def worker_main(model_dir: str, device: str, cpu_threads: int, greedy: bool, max_frames: int | None,
                batch_size: int, engine_rows: int, depth: str, codec_precision: str, talker_precision: str,
                verbose_log: bool, parent_pid: int, tasks,
                results) -> None:
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
        results.put(("failed", device, f"{type(e).__name__}: {e}"))
        return
    results.put(("ready", device, (synth.sample_rate, synth.numerics)))
    limit = RowLimit(batch_size)
    while True:
        try:
            task = tasks.get(timeout=POLL_SECONDS)
        except queue.Empty:
            if os.getppid() != parent_pid:
                return   # the parent was killed: nobody would write what this worker makes
            continue
        if task is None:
            return
        index, requests = task
        start = perf_counter()
        try:
            outcomes = synthesize_batch(synth, requests, greedy, max_frames, limit)
        except Exception as e:  # a device fault or a bug: this batch's rows fail with it, the run goes on
            outcomes = [TTSError(f"on {device}: {type(e).__name__}: {e}")] * len(requests)
        results.put(("done", index, outcomes, perf_counter() - start))
