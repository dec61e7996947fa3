"""The `tts` command: parses options, calls the pipeline, prints what happened."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from . import __version__
from .errors import TTSError
from .recipe import load_recipe

BUNDLED_MODEL_DIR = Path(__file__).parent / "assets" / "tiny-1.7b-customvoice"
NOT_IMPLEMENTED_EXIT = 2
# The placeholder commands answer "not implemented" whatever they are given.
ACCEPT_ANY_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}

app = typer.Typer(
    name="tts",
    help="Offline batch text-to-speech for Qwen3-TTS 12Hz CustomVoice checkpoints.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain click help: readable in any terminal, log or test
)
stderr = Console(stderr=True, highlight=False)


def say(message: str, style: str) -> None:
    """One line on stderr, never wrapped and never read as rich markup (messages hold paths and ids)."""
    stderr.print(Text(message, style=style), soft_wrap=True)


@dataclass
class ModelChoice:
    dir: Path
    source: str  # "--model", "$TTS_MODEL" or "bundled"

    @property
    def bundled(self) -> bool:
        return self.source == "bundled"


def resolve_model(option: Optional[Path]) -> ModelChoice:
    """--model, else $TTS_MODEL, else the bundled tiny model; the directory must exist."""
    if option is not None:
        choice = ModelChoice(option, "--model")
    elif os.environ.get("TTS_MODEL"):
        choice = ModelChoice(Path(os.environ["TTS_MODEL"]), "$TTS_MODEL")
    else:
        choice = ModelChoice(BUNDLED_MODEL_DIR, "bundled")
    if choice.dir.resolve() == BUNDLED_MODEL_DIR.resolve():
        choice = ModelChoice(choice.dir, "bundled")  # named explicitly (or by a recipe): still random weights
    if not choice.dir.is_dir():
        origin = "the bundled model is missing from this install" if choice.bundled else f"from {choice.source}"
        raise TTSError(f"model directory not found: {choice.dir} ({origin})")
    return choice


def load_synthesizer(model_dir: Path, device: str):
    """Imported here, not at the top: torch and the model load only for commands that synthesize."""
    import torch

    from .synthesizer import Synthesizer

    return Synthesizer.from_pretrained(model_dir, device=device, dtype=torch.float32)


def check_device(device: str) -> None:
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError as e:
        raise TTSError(f"--device {device!r}: {e}") from e
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise TTSError(f"--device {device!r}: torch reports no CUDA device on this machine")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"tts {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the tts version and exit."),
) -> None:
    """Offline batch text-to-speech for Qwen3-TTS 12Hz CustomVoice checkpoints."""


@app.command(short_help="Synthesize a manifest into WAV files plus report.json and report.md.")
def synth(
    ctx: typer.Context,
    manifest: Path = typer.Argument(
        ..., metavar="MANIFEST", show_default=False,
        help="Rows to speak: .txt (one sentence per line, or id<TAB>text) or .parquet (column text; "
             "optional id, speaker, language, instruct, seed)."),
    out: Path = typer.Option(
        ..., "--out", metavar="DIR", show_default=False,
        help="Folder for one WAV per row (24 kHz, 16-bit, named by the sanitized row id) and "
             "report.json / report.md; created if missing, same-named files are replaced."),
    model: Optional[Path] = typer.Option(
        None, "--model", metavar="DIR", show_default=False,
        help="Checkpoint folder in the official Qwen3-TTS-12Hz CustomVoice layout. Default: $TTS_MODEL, "
             "else the bundled tiny model, whose weights are random (its audio is noise)."),
    speaker: str = typer.Option(
        "vivian", metavar="NAME", help="Speaker for rows that name none; must be one of the checkpoint's."),
    language: str = typer.Option(
        "auto", metavar="NAME", help="Language for rows that name none: auto or one of the checkpoint's."),
    seed: int = typer.Option(
        0, metavar="SEED",
        help="Base seed: a row without its own seed uses SEED + its 0-based row index in the manifest "
             "(empty rows count). Unused with --greedy."),
    greedy: bool = typer.Option(
        False, "--greedy",
        help="No sampling: argmax in both the talker and the code predictor (the official "
             "do_sample=False, subtalker_dosample=False)."),
    max_frames: Optional[int] = typer.Option(
        None, "--max-frames", metavar="N", min=1, show_default=False,
        help="Stop each row after N codec frames (12.5 frames per audio second) and flag it hit_cap. "
             "Default: 50 + 15 frames per text token, within the checkpoint's max_new_tokens."),
    batch_size: int = typer.Option(
        8, "--batch-size", metavar="ROWS", min=1, help="Rows synthesized together in one call."),
    device: str = typer.Option("cpu", metavar="DEVICE", help="Torch device (only cpu is tested so far)."),
    recipe: Optional[str] = typer.Option(
        None, "--recipe", metavar="NAME|FILE", show_default=False,
        help="Option defaults from a YAML recipe: a file, or a name in recipes/ (tiny, "
             "qwen3tts-1.7b-customvoice, ...). Options given here win; 'model: bundled' means the bundled model."),
) -> None:
    """Synthesize every row of MANIFEST into DIR, then write report.json and report.md.

    Invalid rows (unknown speaker or language, ...) fail with the reason and the others go on.
    Empty rows are skipped and counted.

    Exit status: 0 every row succeeded; 1 some rows failed (see the report);
    2 the run could not start (bad manifest, model, option), with one red line saying why.
    """
    try:
        if recipe is not None:
            options = apply_recipe(ctx, load_recipe(recipe), dict(
                model=model, speaker=speaker, language=language, seed=seed, greedy=greedy,
                max_frames=max_frames, batch_size=batch_size, device=device))
            model, speaker, language, seed, greedy, max_frames, batch_size, device = (
                options[k] for k in ("model", "speaker", "language", "seed", "greedy", "max_frames",
                                     "batch_size", "device"))
        exit_code = run_synth(manifest, out, model, speaker, language, seed, greedy, max_frames, batch_size, device)
    except TTSError as e:
        say(f"error: {e}", "red")
        raise typer.Exit(2)
    raise typer.Exit(exit_code)


def apply_recipe(ctx: typer.Context, recipe: dict, options: dict) -> dict:
    """Recipe values replace the options left at their defaults (not those given on the command line)."""
    merged = dict(options)
    for key, value in recipe.items():
        # compared by name: typer ships its own copy of click's ParameterSource enum
        if ctx.get_parameter_source(key).name == "DEFAULT":
            merged[key] = BUNDLED_MODEL_DIR if (key == "model" and value == "bundled") else (
                Path(value) if key == "model" else value)
    return merged


def run_synth(manifest_path: Path, out: Path, model_option: Optional[Path], speaker: str, language: str,
              seed: int, greedy: bool, max_frames: Optional[int], batch_size: int, device: str) -> int:
    # Imported here so that --help and the placeholder commands start without loading torch.
    from .job import synthesize_rows, validate_rows
    from .manifest import RowDefaults, read_manifest
    from .output.report import RunInfo, build_report, write_reports

    # Everything that can be checked without the model is checked before it loads.
    choice = resolve_model(model_option)
    manifest = read_manifest(manifest_path, RowDefaults(speaker, language, seed))
    if not manifest.requests:
        raise TTSError(f"{manifest_path}: no non-empty rows ({manifest.skipped_empty} empty rows skipped)")
    if manifest.ignored_columns:
        say(f"note: {manifest_path}: ignoring unknown columns {', '.join(manifest.ignored_columns)}", "yellow")
    check_device(device)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TTSError(f"cannot create output folder {out}: {e}") from e

    if choice.bundled:
        say(f"warning: using the bundled tiny model ({choice.dir}): random weights: its audio is noise; "
            "pass --model or set TTS_MODEL to a real Qwen3-TTS-12Hz CustomVoice checkpoint", "yellow")
    load_start = perf_counter()
    synth = load_synthesizer(choice.dir, device)
    load_seconds = perf_counter() - load_start

    records, pending = validate_rows(synth, manifest.requests)
    for record in records:
        if not record.ok:
            say(f"row {record.request.id}: {record.error}", "yellow")

    with Progress(TextColumn("synthesizing"), BarColumn(), MofNCompleteColumn(), TextColumn("rows"),
                  TextColumn("{task.fields[audio_seconds]:.1f} s audio"), TimeElapsedColumn(),
                  console=stderr) as progress:
        task = progress.add_task("synth", total=len(pending), audio_seconds=0.0)

        def on_batch_done(batch_records) -> None:
            for record in batch_records:
                if not record.ok:
                    say(f"row {record.request.id}: {record.error}", "red")
            audio = progress.tasks[task].fields["audio_seconds"]
            audio += sum(record.audio_seconds or 0.0 for record in batch_records)
            progress.update(task, advance=len(batch_records), audio_seconds=audio)

        wall_seconds = synthesize_rows(synth, pending, out, batch_size=batch_size, greedy=greedy,
                                       max_frames=max_frames, on_batch_done=on_batch_done)

    report = build_report(RunInfo(
        manifest=str(manifest_path), model_dir=str(choice.dir), model_source=choice.source,
        bundled_random_model=choice.bundled, device=device, dtype="float32", greedy=greedy, base_seed=seed,
        max_frames=max_frames, batch_size=batch_size, skipped_empty=manifest.skipped_empty,
        load_seconds=load_seconds, wall_seconds=wall_seconds, tts_version=__version__,
    ), records)
    _, md_path = write_reports(out, report)
    totals = report["totals"]
    typer.echo(f"{totals['ok']} rows ok, {totals['failed']} failed, {totals['skipped_empty']} empty skipped; "
               f"{totals['audio_seconds']:.2f} s audio in {totals['wall_seconds']:.2f} s "
               f"(xRT {totals['xrt']}); report: {md_path}")
    return 0 if totals["failed"] == 0 else 1


@app.command(context_settings=ACCEPT_ANY_ARGS,
             help="Not implemented yet (issue: engine). Prints that and exits with status 2.")
def bench() -> None:
    say("tts bench: not implemented yet (issue: engine)", "red")
    raise typer.Exit(NOT_IMPLEMENTED_EXIT)


@app.command("verify-golden", context_settings=ACCEPT_ANY_ARGS,
             help="Not implemented yet (issue: quality). Prints that and exits with status 2.")
def verify_golden() -> None:
    say("tts verify-golden: not implemented yet (issue: quality)", "red")
    raise typer.Exit(NOT_IMPLEMENTED_EXIT)
