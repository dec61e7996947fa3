"""ASR in worker processes, fed row by row while the caller goes on (synthesizing, or reading files).

    with AsrPool(model_path, workers=1) as pool:
        pool.submit(key, wav_path, text, language)   # returns at once; key: unique per row
        pool.submit(key2, (samples, 24000), text, language)  # or audio in memory, or a file's bytes
        ...
        heard = pool.results()                       # waits; {key: Transcript | error text}

Each worker loads the model once. Processes, not threads: CTranslate2 and torch each want their
own cores, and a crash or a stuck transcription stays in the worker. Started with "spawn" so that
a worker holds no copy of the caller's torch state; they end with the caller, also when it is
SIGKILLed (tts_cli/processes.py). A stop (SIGTERM, Ctrl-C) cuts the wait for results short.
"""
from __future__ import annotations

import multiprocessing
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from ..errors import TTSError
from ..processes import RunStopped, end_with_parent, stops_here
from .asr import AudioSource, Transcriber, Transcript, describe_source

_worker_transcriber: Transcriber | None = None  # one per worker process
# No row heard for this long while rows wait: a worker is stuck (a row takes seconds, a large model's
# longest well under a minute on CPU), and the run ends without those rows' WER rather than never.
STALL_SECONDS = 600.0


def _load_in_worker(model_path: str, cpu_threads: int) -> None:
    global _worker_transcriber
    end_with_parent()
    from tqdm import tqdm   # faster-whisper's dependency: here, where it runs

    # faster-whisper opens a tqdm bar (disabled) per transcription, and tqdm's default lock includes a
    # multiprocessing RLock, registered with the resource tracker that this worker shares with tts. A worker
    # ended by SIGTERM (a scheduler's, sent to the whole group) never unregisters it, and the tracker reports it
    # leaked when tts ends. The bars are this process's alone: a thread lock is all they need.
    tqdm.set_lock(threading.RLock())
    _worker_transcriber = Transcriber(Path(model_path), cpu_threads)


def _transcribe_in_worker(source: AudioSource, text: str, language: str) -> Transcript | str:
    try:
        return _worker_transcriber.transcribe(source, text, language)
    except Exception as e:  # an unreadable or odd file fails its row only
        return f"ASR failed on {describe_source(source)}: {type(e).__name__}: {e}"


def _nothing() -> None:
    pass


class NotHeard(str):
    """Why a row's audio was not transcribed, though nothing is wrong with it (the run stopped first,
    or an ASR worker died): the row is not scored, not failed."""


class _Stalled(Exception):
    pass


class AsrPool:
    def __init__(self, model_path: Path, workers: int = 1, cpu_threads_per_worker: int = 1, start_now: bool = False):
        """start_now: start the workers (and load the model) at once rather than at the first submit."""
        self.model_path = Path(model_path)
        self._executor = ProcessPoolExecutor(
            max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=_load_in_worker, initargs=(str(model_path), cpu_threads_per_worker))
        self._futures: dict[str, Future] = {}
        self._broken: BrokenProcessPool | None = None   # met by a submit: results() reports it
        for _ in range(workers if start_now else 0):
            self._executor.submit(_nothing)

    def submit(self, key: str, audio: Path | str | AudioSource, text: str, language: str) -> None:
        """audio: a file's path, an encoded audio file's bytes, or (float samples, sample rate).
        Never fails for a dead worker: the caller is synthesizing, and results() reports it."""
        if key in self._futures:
            raise ValueError(f"row {key!r} submitted twice")
        source = Path(audio) if isinstance(audio, str) else audio
        try:
            self._futures[key] = self._executor.submit(_transcribe_in_worker, source, text, language)
        except BrokenProcessPool as e:   # a worker died and the pool has noticed it already
            self._broken = self._broken or e
            lost: Future = Future()           # results() reports the row as not heard, as those that waited
            lost.set_exception(e)
            self._futures[key] = lost

    def results(self) -> dict[str, Transcript | str]:
        """Every submitted row: its Transcript, or the error text of a row whose file could not be
        heard, or NotHeard: the run was stopped, a worker died, or none answered for STALL_SECONDS
        (its workers are then ended), while it waited. Raises TTSError when a worker died before any
        row was heard (the model would not load, most likely)."""
        heard: dict[str, Transcript | str] = {}
        try:
            with stops_here():
                if self._broken is not None:
                    raise self._broken
                waiting = set(self._futures.values())
                while waiting:
                    answered, waiting = wait(waiting, timeout=STALL_SECONDS, return_when=FIRST_COMPLETED)
                    if not answered:
                        raise _Stalled
                for key, future in self._futures.items():
                    heard[key] = future.result()
        except _Stalled:
            self._keep_finished(heard, f"not heard: the ASR heard no row for {STALL_SECONDS:g} s (a worker is stuck)")
            # a stuck worker would hold close() (the pool's shutdown) forever; the pool keeps its processes
            # in a private dict, the only way to them
            for process in list((getattr(self._executor, "_processes", None) or {}).values()):
                process.terminate()
        except BrokenProcessPool as e:
            self._keep_finished(heard, f"not heard: an ASR worker died (killed, or out of memory): {e}")
            if all(isinstance(result, NotHeard) for result in heard.values()):
                raise TTSError(f"an ASR worker died (model {self.model_path} could not be loaded, or a worker was "
                               f"killed or ran out of memory): {e}") from e
        except RunStopped as stop:
            self._keep_finished(heard, f"not heard: the run was {stop}")
        return heard

    def _keep_finished(self, heard: dict, why: str) -> None:
        """What the workers heard before the stop or the death is kept; the other rows are NotHeard(why)."""
        heard.update((key, future.result() if future.done() and not future.cancelled()
                      and future.exception() is None else NotHeard(why))
                     for key, future in self._futures.items() if key not in heard)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "AsrPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
