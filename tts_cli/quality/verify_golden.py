"""`tts verify-golden`: a checkpoint against golden records of the official implementation, printed
as a table of checks; or, with --record, new golden records made by the official code."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from rich.table import Table
from rich.text import Text

from .. import install_hint
from ..errors import TTSError
from .golden import Check

BUNDLED_GOLDEN_DIR = Path(__file__).resolve().parents[1] / "assets" / "golden" / "tiny-1.7b-customvoice"
RECORD_FILES = ("records.safetensors", "records.json")
CHECKED_DTYPES = ("float32", "float16", "bfloat16")


def check_dtype(dtype: str) -> None:
    if dtype not in CHECKED_DTYPES:
        raise TTSError(f"--dtype {dtype}: not checkable: the checks have thresholds for float32 (our model in "
                       "fp32), float16 and bfloat16 (the engine's numerics) only")


def numerics_title(device: str, dtype: str) -> str:
    """What the checked model computes in, for the table's title."""
    if dtype == "float32":
        return f"{device}, float32"
    weights = {"float16": "fp16", "bfloat16": "bf16"}[dtype]
    if device.startswith("cuda"):
        return (f"{device}, {dtype}: {weights} weights, fp32 activations, fused kernels; "
                "codec fp32 with TF32, its vocoder's convolutions with fp16 inputs (the engine's numerics)")
    return f"{device}, {dtype}: {weights} weights, fp32 activations, plain torch path; codec fp32"


@contextmanager
def _tf32(on: bool) -> Iterator[None]:
    """TF32 for the codec as `tts synth` runs it on CUDA (allow_tf32), the flags restored afterwards."""
    import torch

    from ..synthesizer import allow_tf32
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    if on:
        allow_tf32()
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def verify(model_dir: Path, golden_dir: Path, device: str, dtype: str = "float32") -> list[Check]:
    import torch

    from ..synthesizer import Synthesizer
    from .golden import NUMERICS, compare, load_records

    missing = [name for name in RECORD_FILES if not (golden_dir / name).is_file()]
    if missing:
        raise TTSError(f"golden records not found: {golden_dir} lacks {', '.join(missing)}")
    tensors, meta = load_records(golden_dir)
    check_records_fit(meta, model_dir, golden_dir)
    # Every kind goes through the engine on cuda, as `tts synth` runs it: the plain model's
    # projections take fp32 weights only (16-bit weights are the engine's fused kernels').
    synth = Synthesizer.from_pretrained(model_dir, device=device, dtype=getattr(torch, dtype))
    cuda = device.startswith("cuda")
    if dtype != "float32" and cuda:
        from ..engine.runner import use_fused_kernels
        use_fused_kernels(synth.model, synth.codec, torch.device(device), True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the records' reduction order (recorded with one thread), for exact codes on CPU
    try:
        with _tf32(dtype != "float32" and cuda):
            return compare(synth, tensors, meta, NUMERICS[dtype])
    finally:
        torch.set_num_threads(threads)


def check_records_fit(meta: dict, model_dir: Path, golden_dir: Path) -> None:
    """Records made for one kind and size of checkpoint check only that kind and size: another
    fails most checks, or refuses its prompts, for no fault of ours."""
    from ..checkpoint import CUSTOM_VOICE, MODEL_KINDS, MODEL_SIZES, open_checkpoint

    config = open_checkpoint(model_dir).config
    kind, size = meta.get("tts_model_type", CUSTOM_VOICE), meta.get("tts_model_size")
    if kind != config.model_type or (size is not None and size != config.model_size):
        made_for = f"{MODEL_KINDS.get(kind, kind)} {MODEL_SIZES.get(size, size or '')}".strip()
        raise TTSError(f"the records in {golden_dir} were made for a {made_for} checkpoint, and {model_dir} is "
                       f"{config.name}: give --golden records of this checkpoint (tts verify-golden --record)")


def import_reference() -> None:
    """Imports the official implementation that record_golden runs (extra [reference]); TTSError says how to
    install it. Called before --record makes its folder, so a missing extra leaves none behind."""
    from . import reference
    try:
        reference.import_official()
    except ImportError as e:
        raise TTSError(f"the official implementation is not importable ({e}): install the extra "
                       f"[reference] ({install_hint('reference')}: qwen-tts-hf; the Makefile names versions that "
                       "work)") from e


def record_golden(model_dir: Path, out_dir: Path, device: str = "cpu", frames: int | None = None,
                  prompts: int | None = None) -> dict:
    """Run the official implementation on model_dir (fp32; on `device`, TF32 off) and write its
    records into out_dir. frames: forced frames per prompt (default reference.FORCED_FRAMES, for
    Base and VoiceDesign FORCED_FRAMES_VOICES; the unforced run then stops at the same length);
    prompts: the first N prompts only. import_reference() comes first."""
    from . import reference
    options = {}
    if frames is not None:
        options.update(frames=frames, natural_max_new_tokens=frames + 1)
    if prompts is not None:
        options["prompt_count"] = prompts
    tensors, meta = reference.record(model_dir, device=device, **options)
    reference.write_golden(out_dir, tensors, meta)
    return meta


def checks_table(checks: list[Check], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column, justify in (("check", "left"), ("value", "right"), ("threshold", "right"), ("result", "left")):
        table.add_column(column, justify=justify)
    for check in checks:
        table.add_row(Text(check.name), check.value_text(), check.threshold_text(), _result(check))
    return table


def _result(check: Check) -> Text:
    if check.value is None:
        return Text(check.note, style="yellow")
    if check.informative:
        return Text("info", style="cyan")
    return Text("pass", style="green") if check.passed else Text("FAIL", style="bold red")
