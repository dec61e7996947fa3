"""`tts synth` in a child process, SIGKILLed once its ledger holds a given number of rows: what a
preempted batch job leaves behind, for the resume tests."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tts_cli.output.ledger import LEDGER_NAME

REPO = Path(__file__).resolve().parents[1]


def synth_command(arguments: list[str], out: Path) -> tuple[list[str], dict]:
    """`tts synth ARGUMENTS --out OUT` as a child process: its command line and environment."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("TTS_MODEL", None)
    return [sys.executable, "-m", "tts_cli", "synth", *arguments, "--out", str(out)], env


def synth_killed_after(arguments: list[str], out: Path, rows: int, timeout: float = 120) -> None:
    """Runs `tts synth ARGUMENTS --out OUT` and SIGKILLs it once OUT's ledger has `rows` lines;
    fails if it ends by itself first."""
    command, env = synth_command(arguments, out)
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        ledger = out / LEDGER_NAME
        if ledger.is_file() and ledger.read_text().count("\n") >= rows:
            break
        time.sleep(0.02)
    assert process.poll() is None, f"the run ended before it could be killed: {process.stderr.read().decode()}"
    process.send_signal(signal.SIGKILL)
    process.wait()
    process.stderr.close()
