"""`tts -v`: the engine's choices and fallbacks (INFO records of our packages) as lines on stderr,
in the main process and in the worker processes of `--gpus`."""
from __future__ import annotations

import logging
import sys

LOGGERS = ("tts_cli", "tts_kernels")   # the packages whose choices --verbose shows
_handler: logging.Handler | None = None


def log_to_stderr(verbose: bool, prefix: str = "tts") -> None:
    """With verbose, INFO lines of LOGGERS on stderr as `PREFIX: ...`; without, none of ours."""
    global _handler
    if _handler is not None:
        for name in LOGGERS:
            logging.getLogger(name).removeHandler(_handler)
    _handler = None
    if verbose:
        _handler = logging.StreamHandler(sys.stderr)
        _handler.setFormatter(logging.Formatter(f"{prefix}: %(message)s"))
        for name in LOGGERS:
            logging.getLogger(name).addHandler(_handler)
            logging.getLogger(name).setLevel(logging.INFO)


def verbose() -> bool:
    """Whether log_to_stderr(True) is in effect (so that worker processes do the same)."""
    return _handler is not None
