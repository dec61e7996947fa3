"""How tts's processes end: children with their parent, the parent's run on SIGTERM or Ctrl-C.

Children (the `--gpus` workers, the ASR workers, all started by multiprocessing with spawn) call
end_with_parent() first. They end when the parent ends, also when it is SIGKILLed: on Linux the
kernel sends them SIGKILL then (PR_SET_PDEATHSIG), and everywhere a thread of theirs waits on the
pipe multiprocessing keeps open from the parent and ends the process at its EOF (a blocking read,
no polling). They ignore SIGINT: a Ctrl-C reaches the whole process group, and it is the parent
that stops them. SIGTERM keeps its default, ending them at once: it is how the parent and
multiprocessing stop them (a scheduler's SIGTERM to the whole group may end a worker before the
parent stops: the rows it held and had not sent are then recorded as failed, and a rerun redoes
them). The multiprocessing resource tracker, the one other helper process, ends by itself
at the EOF of its own pipe, once the parent and these children (which hold that pipe too) are gone.

The parent: while stop_on_signals() is active, SIGTERM (what Slurm, Kubernetes and Ray send before
SIGKILL) and SIGINT stop the run. A stop cuts short only the waits marked with stops_here()
(loading the model, encoding references, the ASR): RunStopped is raised there, at once. The wait
for synthesis ends itself instead (stop_signal(), tts_cli/job.py): a signal raised wherever it lands
there would drop the rows already synthesized and handed over but not yet written. Anywhere else (a
batch's rows being written and recorded, the report) the stop waits for the next such wait or for
the end of the run, so that what is finished is on disk, in the ledger and in the report.
"""
from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

PR_SET_PDEATHSIG = 1            # linux/prctl.h
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOP_POLL_SECONDS = 0.25        # how soon a wait that ends itself (stop_signal) sees a stop
PARENT_GONE_EXIT = 1


def end_with_parent() -> None:
    """Make this child process end when the process that started it ends. Call it first thing in
    the child's entry: PR_SET_PDEATHSIG fires when the parent thread that started the child ends
    (tts starts its children from the main thread), and a parent that died before it was set is
    caught by comparing getppid() right after."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is None:
        raise RuntimeError("end_with_parent() is for processes started by multiprocessing")
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent.pid:
            os._exit(PARENT_GONE_EXIT)
    threading.Thread(target=_exit_when_gone, args=(parent,), name="tts-parent-watch", daemon=True).start()


def _exit_when_gone(parent) -> None:
    parent.join()   # blocks until EOF of the pipe that only the parent holds open
    os._exit(PARENT_GONE_EXIT)


class RunStopped(BaseException):
    """A run stopped by a signal. A BaseException, like KeyboardInterrupt: no `except Exception`
    around a batch may take it for a row's fault."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def exit_status(self) -> int:
        return 128 + self.signum   # the shell's convention: 143 for SIGTERM, 130 for SIGINT


class RunCannotGoOn(RunStopped):
    """A run stopped by what it needs failing (every --gpus worker died), not by a signal. It ends as a
    stopped run does (its finished rows recorded, the report written), then with exit status 2."""

    def __init__(self, reason: str):
        BaseException.__init__(self, reason)
        self.signum = None

    @property
    def exit_status(self) -> int:
        return 2


class StopRequest:
    """The first stop signal of a run (later ones are ignored: the stop is under way)."""

    def __init__(self):
        self.signum: int | None = None
        self._interruptible = 0   # depth of stops_here() sections

    def _handle(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum = signum
            if self._interruptible:
                raise RunStopped(signum)

    def raise_if_stopped(self) -> None:
        if self.signum is not None:
            raise RunStopped(self.signum)


_current: StopRequest | None = None


@contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """SIGTERM and SIGINT stop the run while active (see the module's doc); the previous handlers
    come back after. Outside the main thread (where Python runs no signal handlers) nothing is set."""
    global _current
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {signum: signal.signal(signum, request._handle) for signum in STOP_SIGNALS}
    _current = request
    try:
        yield request
    finally:
        _current = None
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def stop_signal() -> int | None:
    """The stop signal that came, if any: for a wait that must end where it loses nothing, not wherever
    the signal lands (stops_here)."""
    return None if _current is None else _current.signum


@contextmanager
def stops_here() -> Iterator[None]:
    """A wait that a stop cuts short: RunStopped is raised in it as the signal comes, or on
    entering it when the signal came before."""
    request = _current
    if request is None:
        yield
        return
    request._interruptible += 1   # before the check: a signal in between is raised by the handler
    try:
        request.raise_if_stopped()
        yield
    finally:
        request._interruptible -= 1
