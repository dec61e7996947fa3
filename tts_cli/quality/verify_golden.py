"""`tts verify-golden`: a checkpoint against golden records of the official implementation, printed
as a table of checks; or, with --record, new golden records made by the official code."""
from __future__ import annotations

from pathlib import Path

from rich.table import Table
from rich.text import Text

from ..errors import TTSError
from .golden import Check

BUNDLED_GOLDEN_DIR = Path(__file__).resolve().parents[1] / "assets" / "golden" / "tiny-1.7b-customvoice"
RECORD_FILES = ("records.safetensors", "records.json")
CHECKED_DTYPE = "float32"
BF16_NOTE = ("the thresholds here are for float32 (relative L2 <= 1e-4, exact codes); bfloat16 needs its own "
             "thresholds (logit cosine and argmax agreement), which the engine issue defines")


def check_dtype(dtype: str) -> None:
    if dtype != CHECKED_DTYPE:
        raise TTSError(f"--dtype {dtype}: not checkable yet: {BF16_NOTE}")


def verify(model_dir: Path, golden_dir: Path, device: str) -> list[Check]:
    import torch

    from ..synthesizer import Synthesizer
    from .golden import compare, load_records

    missing = [name for name in RECORD_FILES if not (golden_dir / name).is_file()]
    if missing:
        raise TTSError(f"golden records not found: {golden_dir} lacks {', '.join(missing)}")
    tensors, meta = load_records(golden_dir)
    synth = Synthesizer.from_pretrained(model_dir, device=device, dtype=torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the records' reduction order (recorded with one thread), for exact codes on CPU
    try:
        return compare(synth, tensors, meta)
    finally:
        torch.set_num_threads(threads)


def record_golden(model_dir: Path, out_dir: Path) -> dict:
    """Run the official implementation on model_dir (CPU, fp32) and write its records into out_dir."""
    from . import reference
    try:
        reference.import_official()
    except ImportError as e:
        raise TTSError(f"the official implementation is not importable ({e}): install the extra "
                       "`pip install 'tts[reference]'` (qwen-tts-hf; the Makefile names versions that work)") from e
    tensors, meta = reference.record(model_dir)
    reference.write_golden(out_dir, tensors, meta)
    return meta


def checks_table(checks: list[Check], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column, justify in (("check", "left"), ("value", "right"), ("threshold", "right"), ("result", "left")):
        table.add_column(column, justify=justify)
    for check in checks:
        table.add_row(Text(check.name), _value(check), "equal" if check.exact else f"<= {check.threshold:.0e} rel. L2",
                      _result(check))
    return table


def _value(check: Check) -> str:
    if check.value is None:
        return "-"
    if check.exact:
        return "equal" if check.value == 0 else "differs"
    return f"{check.value:.2e}"


def _result(check: Check) -> Text:
    if check.value is None:
        return Text(check.note, style="yellow")
    return Text("pass", style="green") if check.passed else Text("FAIL", style="bold red")
