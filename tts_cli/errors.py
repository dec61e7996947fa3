"""Errors a user can act on. Each message names the file, field or row at fault."""
import errno
from contextlib import contextmanager


class TTSError(Exception):
    """Base class: the CLI prints these without a traceback."""


class CheckpointError(TTSError):
    """A checkpoint file is missing or malformed (the message names the file)."""


class UnsupportedModelError(TTSError):
    """The checkpoint is valid but of a kind `tts` does not synthesize yet (Base, VoiceDesign)."""


class RequestError(TTSError):
    """One manifest row cannot be synthesized (unknown speaker, empty text...); other rows go on."""


class CodecRangeError(TTSError):
    """The engine's fp16 vocoder met values beyond fp16's range: its audio would be wrong, so it is
    refused (the message says how to run the vocoder in fp32 instead)."""


class NonFiniteError(TTSError):
    """The talker or code predictor produced NaN or infinite logits (with fp16 projections: most
    likely an activation beyond fp16's range): the audio would be wrong, so it is refused."""


class OutputError(TTSError):
    """The output folder cannot be written (disk full, an I/O error, a read-only folder): every
    later row would fail too, so the run stops. The message names the path, the OS's reason and what to do
    about it (_REMEDIES)."""

    def __init__(self, path, error: OSError):
        self.path, self.reason, self.errno = path, error.strerror or error, error.errno
        super().__init__(f"cannot write {path}: {self.reason}; the run stopped (rows already recorded are kept): "
                         f"{_REMEDIES.get(self.errno, 'fix the folder')}, then rerun the same command to resume")


# What an OutputError tells the user to do, by the OS's error number: a folder that refuses writes is not full.
_REMEDIES = {errno.ENOSPC: "free space", errno.EDQUOT: "free space", errno.EACCES: "make the folder writable",
             errno.EPERM: "make the folder writable", errno.EROFS: "make the folder writable"}


@contextmanager
def without_resume_advice(what: str):
    """An OutputError raised inside becomes "cannot write WHAT PATH: REASON", for a command that keeps no ledger
    (tts bench, tts score): a rerun of it redoes everything, resuming nothing."""
    try:
        yield
    except OutputError as e:
        raise TTSError(f"cannot write {what} {e.path}: {e.reason}") from None


class SynthesisCancelled(Exception):
    """A stopped run's synthesis, ended early on purpose (not a TTSError: no row is at fault)."""
