"""One `tts synth` run into an output folder: plan the rows against the ledger, synthesize what is
left, write each finished row and record it, then rebuild the report from the ledger.

- Resume: a row whose ledger entry has the same key (text + settings) and whose output is there is
  skipped. So is one whose settings differ only where they cannot change its output (same_output):
  a setting its checkpoint ignores (JobSettings.ignored_params), or segment_chars where its text fits
  both limits (one segment under either). A row done before with other text or settings stops the run
  before the model loads, unless --redo-changed.
- Long text: a row is split into segments (tts_cli/textsplit.py), each synthesized as a request of
  its own with its own frame cap, and the segments' audio is joined with a short crossfade.
- Faults: a RequestError fails only the row at fault (its batch is retried row by row); a CUDA
  out-of-memory halves the rows per synthesize call and retries, and a row that runs out of memory
  even alone fails with that error. Finished rows are on disk and in the ledger as they end,
  so nothing produced is lost to a later fault or a kill.
- A worker process that dies fails the rows it held and had not sent (tts_cli/scale/workers.py);
  an output that cannot be written (disk full, I/O error, read-only folder) stops the run with
  OutputError: its row gets no ledger line, the rows of its batch that were written keep theirs.
- SIGTERM or Ctrl-C (tts_cli/processes.py) stops the synthesis and ends the wait for the next
  results, never the writing and recording of finished rows: those already handed over (queued by
  the synthesis thread, sent by a worker) are written too, none still being made is waited for. The
  run then returns what the ledger holds, with JobResult.stopped set.
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from time import perf_counter
from typing import Callable, Iterator, Protocol

import numpy as np
import torch

from .engine import DEFAULT_CODEC_PRECISION, DEFAULT_DEPTH, DEFAULT_ENGINE_ROWS, DEFAULT_TALKER_PRECISION
from .errors import OutputError, RequestError, SynthesisCancelled, TTSError
from .manifest import ManifestRow
from .output.formats import SHARD_PATTERN, make_sink, output_exists, output_intact, remove_orphan_shards
from .output.ledger import LEDGER_NAME, FolderLock, Ledger, changed_params, params_key, row_params
from .output.report import NOT_SYNTHESIZED, RUN_FILES, RowRecord
from .output.report_html import PARQUET_AUDIO_FOLDER
from .output.writer import remove_temporary_files, sanitize_id
from .processes import STOP_POLL_SECONDS, RunCannotGoOn, RunStopped, stop_signal, stops_here
from .recipe import wrapped_seed
from .request import Request
from .textsplit import crossfade_samples, join_with_crossfade, split_text

log = logging.getLogger(__name__)
# The ledger line of a row about to be made again over its earlier file (--redo-changed): a run killed
# before the row's new line leaves it to be redone, not its earlier line naming a file being replaced.
REDO_PENDING = "left to be synthesized again (--redo-changed)"

DEFAULT_SEGMENT_CHARS = 300      # about 20 s of speech: far inside the talker's context and frame caps
SEGMENT_SEED_STRIDE = 1_000_003  # segment k draws with seed + k * stride: its own noise, still reproducible
OOM_TRIES_ALONE = 2              # a single row out of memory is retried once (the cache may have been fragmented)
WRITER_THREADS = 8               # rows encoded and written at once: libsndfile and fsync release the GIL


@dataclass
class JobSettings:
    output_format: str = "wav"
    greedy: bool = False
    max_frames: int | None = None
    segment_chars: int = DEFAULT_SEGMENT_CHARS
    batch_size: int = 8           # segments per synthesize call
    engine_rows: int | None = DEFAULT_ENGINE_ROWS   # the engine's slots (CUDA; None: per call, --rows auto)
    depth: str = DEFAULT_DEPTH    # how the engine runs the code predictor (CUDA)
    codec_precision: str = DEFAULT_CODEC_PRECISION   # the engine's vocoder convolution inputs (CUDA)
    talker_precision: str = DEFAULT_TALKER_PRECISION   # the talker's and code predictor's weights (CUDA)
    model: str = ""               # the checkpoint folder, part of each row's key
    # tts_cli.checkpoint.fingerprint of its files: in each ledger line beside the key (lines written
    # before it was kept have none), so that another checkpoint put in that folder makes a changed row
    model_fingerprint: str = ""
    redo_changed: bool = False
    # a row's settings its checkpoint ignores (an instruct on a CustomVoice 0.6B): a row made before with
    # another value is the same row (tts_cli.manifest.RowDefaults.takes_instruct)
    ignored_params: tuple[str, ...] = ()

    def audio_settings(self) -> dict:
        """The settings that shape a row's output, hashed into its ledger key (batch size, engine
        rows, depth, codec and talker precision and device are not among them: a row's audio does
        not depend on its batch, and the code paths compute the same function, up to float rounding)."""
        return {"model": self.model, "greedy": self.greedy, "max_frames": self.max_frames,
                "segment_chars": self.segment_chars, "format": self.output_format}


@dataclass
class Segment:
    """What synthesizing one segment gave; small and picklable, to cross process boundaries."""
    audio: np.ndarray
    frames: int
    hit_cap: bool


Outcome = Segment | TTSError
# on_output(record, audio, sample_rate): a row whose output is there, for ASR beside synthesis.
# Resumed rows: record.file from the ledger, audio None. Rows of this run, as soon as the sink took
# them: with --format wav/flac record.file is their written file; audio is always given.
OutputCallback = Callable[["RowRecord", np.ndarray | None, int | None], None]


# What an executor yields: (batch index, (position in the batch, outcome) pairs, seconds since the
# batch started). A batch's outcomes may come over several yields, each position once.
Outcomes = tuple[int, list[tuple[int, Outcome]], float]
# Yielded each STOP_POLL_SECONDS that no outcome came: rows waiting for their parquet shard are written when
# due (PARQUET_MAX_WAIT_S) also while a long batch runs, not only once the next row is done.
NO_OUTCOMES: Outcomes = (-1, [], 0.0)


class Executor(Protocol):
    """Runs batches of requests somewhere (this process, worker processes) and yields their
    outcomes (Outcomes) as they are known."""
    sample_rate: int
    numerics: str     # what the loaded model computes in (Synthesizer.numerics), for the report

    def prepare(self, request: Request) -> Request:
        """The row's request as it is synthesized (a clone row with its encoded reference: prepare_request),
        or RequestError for a row it cannot synthesize."""

    def run(self, batches: list[list[Request]]) -> Iterator[Outcomes]:
        """After a stop signal (tts_cli/processes.py stop_signal): stops synthesizing, yields the outcomes
        already in hand without waiting for others, and returns. Yields NO_OUTCOMES while none come."""

    def close(self, now: bool = False) -> None:
        """now: the run stopped or failed, so no batch still running is wanted."""


@dataclass
class RowLimit:
    """The most rows one synthesize call gets (and the most engine slots it may use); halved at
    each out-of-memory, for the rest of the run."""
    rows: int
    shrinks: int = 0


def prepare_request(request: Request, voices, validate: Callable[[Request], None]) -> Request:
    """The row's request with its encoded reference when it clones a voice (voices:
    tts_cli/voice/voices.py Voices, or None when no row clones one), checked by `validate`."""
    if voices is not None:
        request = voices.attach(request)
    validate(request)
    return request


class LocalExecutor:
    """Batches in this process, on an already loaded synthesizer. voices: see prepare_request.

    Synthesis runs in a thread of its own, and each segment comes out as its row ends in the engine,
    so that the rows finished so far are written while the GPU makes the rest: writing them after
    each call took a 4096-row run at 512 slots from 30.5 to 34.3 s on the H200 (docs/bench.md)."""

    def __init__(self, synth, settings: JobSettings, voices=None):
        self.synth, self.settings, self.voices = synth, settings, voices
        self.sample_rate, self.numerics = synth.sample_rate, synth.numerics
        self.limit = RowLimit(settings.batch_size)
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None

    def prepare(self, request: Request) -> Request:
        return prepare_request(request, self.voices, self.synth.validate)

    def run(self, batches: list[list[Request]]) -> Iterator[Outcomes]:
        found: queue.SimpleQueue = queue.SimpleQueue()   # (index, position, outcome, seconds); an exception; _END

        def synthesize_all() -> None:
            try:
                for index, batch in enumerate(batches):
                    start = perf_counter()
                    synthesize_batch(self.synth, batch, self.settings.greedy, self.settings.max_frames, self.limit,
                                     on_outcome=lambda position, outcome: found.put(
                                         (index, position, outcome, perf_counter() - start)),
                                     cancel=self._cancel)
                    if self._cancel.is_set():
                        break
            except SynthesisCancelled:
                pass
            except BaseException as e:   # raised again in the caller's thread
                found.put(e)
            finally:
                found.put(_END)

        self._thread = threading.Thread(target=synthesize_all, name="tts-synthesis", daemon=True)
        self._thread.start()
        while True:
            items = [_next_item(found, self._cancel)]
            if items[0] is _IDLE:
                yield NO_OUTCOMES
                continue
            while not found.empty() and items[-1] is not _END and not isinstance(items[-1], BaseException):
                items.append(found.get())
            yield from outcomes_by_batch([item for item in items if isinstance(item, tuple)])
            # After a stop, an error of the synthesis it cut short does not take the stop's place.
            if isinstance(items[-1], BaseException) and stop_signal() is None:
                raise items[-1]
            if items[-1] is _END or isinstance(items[-1], BaseException):
                return

    @property
    def notes(self) -> list[str]:
        """What the synthesizer chose on its own (`--rows auto`), for the report."""
        return self.synth.notes

    @property
    def timing(self) -> dict | None:
        """The engine's time (tts_cli/synthesizer.py SynthesisTiming), when it ran."""
        timing = getattr(self.synth, "timing", None)
        return timing.as_dict() if timing is not None and timing.calls else None

    def close(self, now: bool = False) -> None:
        """now: the synthesis thread stops at its next window boundary (or batch, on the plain path)."""
        if now:
            self._cancel.set()
        if self._thread is not None:
            self._thread.join(CANCEL_WAIT_SECONDS if now else None)


_END = object()
_IDLE = object()   # (_next_item: nothing came within STOP_POLL_SECONDS)
CANCEL_WAIT_SECONDS = 60   # a stopped run waits this long for the synthesis thread's current step or batch


def _next_item(found: queue.SimpleQueue, cancel: threading.Event):
    """The next item, or _IDLE when none came within STOP_POLL_SECONDS (so that a stop is seen). After a stop,
    synthesis is cancelled and only what is queued already comes, then _END: rows still being made are not
    waited for."""
    if stop_signal() is None:
        try:
            return found.get(timeout=STOP_POLL_SECONDS)
        except queue.Empty:
            if stop_signal() is None:
                return _IDLE
    cancel.set()
    try:
        return found.get_nowait()
    except queue.Empty:
        return _END


def outcomes_by_batch(found: list[tuple[int, int, Outcome, float]]) -> Iterator[Outcomes]:
    """Rows found together, (batch index, position, outcome, seconds) each, as one Outcomes a batch (its
    seconds: its last row's), to be written together."""
    by_batch: dict[int, list] = {}
    for index, *row in found:
        by_batch.setdefault(index, []).append(row)
    for index, rows in by_batch.items():
        yield index, [(position, outcome) for position, outcome, _ in rows], max(s for *_, s in rows)


def synthesize_batch(synth, requests: list[Request], greedy: bool, max_frames: int | None, limit: RowLimit,
                     on_outcome: Callable[[int, Outcome], None], cancel: threading.Event | None = None) -> None:
    """One outcome per request, surviving out-of-memory (GPU or host) by synthesizing fewer rows at a time.
    on_outcome(position, outcome) has each as soon as it is known (through the engine: as its row
    ends), once per request; after an out-of-memory only the requests without one are run again.
    Nothing here keeps an outcome once on_outcome has it: a row's audio lives as long as on_outcome's
    consumer keeps it, not until the call (thousands of rows on cuda) ends. cancel: once set,
    SynthesisCancelled is raised at the engine's next window boundary."""
    outcomes = _Delivery(on_outcome)
    pending, tries_alone = list(range(len(requests))), 0
    while pending:
        if cancel is not None and cancel.is_set():
            raise SynthesisCancelled()
        chunk = pending[:limit.rows]
        try:
            _isolating_request_errors(synth, requests, chunk, greedy, max_frames, limit.rows, outcomes, cancel)
        except RuntimeError as e:
            memory = exhausted_memory(e)
            if memory is None:
                raise
            release_cached_memory()
            if len(chunk) > 1:
                limit.rows, limit.shrinks = max(1, len(chunk) // 2), limit.shrinks + 1
                pending = [p for p in pending if p not in outcomes]
                continue
            tries_alone += 1
            if tries_alone < OOM_TRIES_ALONE:
                continue
            outcomes(chunk[0], TTSError(f"out of {memory} memory even alone ({tries_alone} tries): {e}"))
        tries_alone = 0
        pending = [p for p in pending if p not in outcomes]


class _Delivery(set):
    """The positions with an outcome; calling it passes on a position's first outcome, keeping only
    its position."""

    def __init__(self, on_outcome: Callable[[int, Outcome], None]):
        super().__init__()
        self.on_outcome = on_outcome

    def __call__(self, position: int, outcome: Outcome) -> None:
        if position not in self:
            self.add(position)
            self.on_outcome(position, outcome)


def exhausted_memory(error: RuntimeError) -> str | None:
    """'GPU' or 'host' when the error is an allocation that failed (fewer rows at a time may fit), else None."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return "GPU"
    if "DefaultCPUAllocator: can't allocate memory" in str(error):   # torch raises a plain RuntimeError
        return "host"
    return None


def release_cached_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _isolating_request_errors(synth, requests: list[Request], positions: list[int], greedy: bool,
                              max_frames: int | None, max_rows: int, deliver: _Delivery,
                              cancel: threading.Event | None) -> None:
    """Synthesizes requests[p] for p in positions, delivering each outcome. When the call fails
    with a TTSError, the rows without an outcome are retried one by one so that only the row at
    fault fails. Out-of-memory passes through to synthesize_batch."""
    def segment(result) -> Segment:
        return Segment(np.asarray(result.audio, dtype=np.float32), result.frames, bool(result.hit_cap))

    try:
        results = synth.synthesize([requests[p] for p in positions], greedy=greedy, max_frames=max_frames,
                                   max_rows=max_rows, cancel=cancel,
                                   on_result=lambda i, result: deliver(positions[i], segment(result)))
    except TTSError as e:
        if len(positions) == 1:
            deliver(positions[0], e)
            return
        for p in [p for p in positions if p not in deliver]:
            _isolating_request_errors(synth, requests, [p], greedy, max_frames, max_rows, deliver, cancel)
        return
    if len(results) != len(positions):
        raise RuntimeError(f"synthesize returned {len(results)} results for {len(positions)} requests")
    for p, result in zip(positions, results):
        if result is not None:   # (None: on_result had it)
            deliver(p, segment(result))


def segment_requests(request: Request, segment_chars: int) -> list[Request]:
    """The row as the requests its segments are synthesized from (one request for short text)."""
    texts = split_text(request.text, segment_chars)
    if len(texts) == 1:
        return [request]
    return [replace(request, id=f"{request.id}#{k + 1}", text=text,
                    seed=wrapped_seed(request.seed + k * SEGMENT_SEED_STRIDE))
            for k, text in enumerate(texts)]


@dataclass
class RowPlan:
    row: ManifestRow
    name: str                    # output file name (the row's own audio name inside a parquet shard)
    params: dict
    key: str
    model_fingerprint: str = ""
    segments: list[Request] = field(default_factory=list)
    outcomes: list[Outcome | None] = field(default_factory=list)
    batch_seconds: dict[int, float] = field(default_factory=dict)   # batch index -> its seconds to this row's end

    @property
    def wall_seconds(self) -> float | None:
        """None for a row no batch ran (refused before it), as for rows refused when the manifest is read."""
        return sum(self.batch_seconds.values()) if self.batch_seconds else None


@dataclass
class JobResult:
    records: list[RowRecord]     # every row of the manifest (shard), in order
    wall_seconds: float
    synthesized: int             # rows attempted in this run
    resumed: int                 # rows whose output an earlier run made
    audio_seconds: float         # made in this run
    notes: list[str]
    stopped: RunStopped | None = None   # what stopped the run before every row was done: a signal, or RunCannotGoOn
    synthesis: dict | None = None       # the executor's timing (LocalExecutor.timing), when it has one


def run_job(rows: list[ManifestRow], names: dict[int, str], out_dir: Path, settings: JobSettings,
            start_executor: Callable[[], Executor],
            on_start: Callable[[int], None] = lambda total: None,
            on_rows_done: Callable[[list[RowRecord]], None] = lambda records: None,
            on_output: OutputCallback | None = None, lock: FolderLock | None = None) -> JobResult:
    """Synthesize the rows not yet done into out_dir. `names` maps a row's index to its output name;
    start_executor is called only when there is something to synthesize, and on_start(rows to do)
    once it has started; on_output: see OutputCallback; lock: a FolderLock that the ledger takes (once the
    folder is checked) and the caller closes, to hold it beyond the job (else the lock ends with the job)."""
    out_dir = Path(out_dir)
    notes: list[str] = []
    if not (out_dir / LEDGER_NAME).exists():
        check_no_foreign_outputs(out_dir, names.values(), settings.output_format)
    with Ledger(out_dir, lock) as ledger:
        if ledger.repaired_bytes:
            notes.append(f"cut a torn last line ({ledger.repaired_bytes} bytes) off the ledger: a run was killed mid-write")
        removed = remove_temporary_files(out_dir)
        if removed:
            notes.append(f"removed {len(removed)} temporary files of a killed run")
        orphans = remove_orphan_shards(out_dir, ledger.named_files)   # any format's run: as it empties report_audio/
        if orphans:
            notes.append(f"removed {len(orphans)} parquet shards that no ledger line names (a killed run's, written "
                         "before their rows were recorded)")
        if settings.output_format != "parquet":   # (a parquet row's name is inside its shard)
            names = names_beside_ledger(rows, names, ledger)
        plans = [plan_row(row, names[row.index], settings) for row in rows
                 if row.problem is None or row.reference_unreadable]
        earlier = dict(ledger.latest)   # what earlier runs recorded: no outcome of this run's
        todo, resumed, kept, replaced, damaged = _rows_to_do(plans, ledger, out_dir, settings)
        if damaged:
            (plan, name), count = damaged[0], len(damaged)
            shards = sorted({name for _, name in damaged if SHARD_PATTERN.fullmatch(name)})
            for shard in shards:   # (a row's own file is written over)
                (out_dir / shard).unlink(missing_ok=True)
            notes.append(f"{count} rows made by an earlier run are made again: their file does not read whole "
                         f"(emptied or cut since; first: row {plan.row.number}, {name})"
                         + (f"; {len(shards)} such parquet shards removed" if shards else ""))
        # A replaced row's file is rewritten before its new ledger line: its old line must stop naming it first.
        ledger.append([_entry(plan, error=REDO_PENDING) for plan in replaced])
        if kept:
            notes.append(f"{len(kept)} rows made by an earlier run are kept though their reference cannot be read "
                         f"now (first: row {kept[0].number}: {kept[0].problem})")
            for row in kept:
                row.problem = None
        if on_output:
            redone = {id(plan) for plan in todo}
            made = [plan for plan in plans if id(plan) not in redone and plan.row.problem is None]
            # by file: a parquet shard's rows one after the other (it is read once for them all)
            for plan in sorted(made, key=lambda plan: ledger.latest[plan.row.request.id]["file"] or ""):
                on_output(_record(plan.row, ledger.latest[plan.row.request.id]), None, None)
        start = perf_counter()
        stopped, synthesis = None, None
        if todo:
            executor, completed = None, False
            try:
                with stops_here():
                    executor = start_executor()
                on_start(len(todo))
                _synthesize(todo, executor, ledger, out_dir, settings, notes, on_rows_done, on_output)
                completed = True
            except RunStopped as e:
                stopped = e
            finally:
                if executor is not None:
                    executor.close(now=not completed)
                    synthesis = getattr(executor, "timing", None)
        wall_seconds = perf_counter() - start
        todo_ids = {plan.row.request.id for plan in todo}

        def outcome(row_id: str) -> dict | None:
            """The ledger's entry for a row, if it is this run's where this run was to make the row."""
            entry = ledger.latest.get(row_id)
            if row_id in todo_ids and (entry is earlier.get(row_id) or (entry or {}).get("error") == REDO_PENDING):
                return None
            return entry

        records = [_record(row, outcome(row.request.id)) for row in rows]
    if stopped is not None:
        left = sum(outcome(row_id) is None for row_id in todo_ids)
        notes.append(f"{stopped}: {left} rows were not synthesized; rerun the same command to resume")
    audio_seconds = sum((outcome(row_id) or {}).get("audio_seconds") or 0.0 for row_id in todo_ids)
    return JobResult(records, wall_seconds, len(todo), resumed, audio_seconds, notes, stopped, synthesis)


def check_no_foreign_outputs(out_dir: Path, names, output_format: str) -> None:
    """In a folder no run has written into (no ledger): files under the names this run writes were put
    there by someone else, and would be overwritten (a row's file) or removed (a parquet shard, taken for
    a killed run's, and a file in report_audio/, taken for report.html's copy, in any format). TTSError
    naming the first."""
    found = [] if output_format == "parquet" else [name for name in names if (out_dir / name).exists()]
    found += sorted(path.name for path in out_dir.iterdir() if SHARD_PATTERN.fullmatch(path.name))
    audio_copies = out_dir / PARQUET_AUDIO_FOLDER   # a parquet run removes those no row names, a wav or flac run all
    if audio_copies.is_dir():
        found += sorted(f"{PARQUET_AUDIO_FOLDER}/{path.name}" for path in audio_copies.iterdir())
    found += [name for name in RUN_FILES if (out_dir / name).exists()]
    if found:
        raise TTSError(f"{out_dir} holds {found[0]}{f' and {len(found) - 1} more' if len(found) > 1 else ''}, "
                       f"named as this run's outputs, but no {LEDGER_NAME} (it is not the folder of an earlier "
                       "run): use an empty or new --out")


def names_beside_ledger(rows: list[ManifestRow], names: dict[int, str], ledger: Ledger) -> dict[int, str]:
    """The rows' file names in a folder an earlier run wrote into: a row of the ledger keeps the file
    it has there; a row new to the folder whose name another row's file holds there (ids that differ
    only in characters a file name cannot keep, or in case, and a row inserted before the other) gets
    the next free `_N` instead of overwriting it. Compared case-insensitively, as output_names does."""
    files = {row_id: entry["file"] for row_id, entry in ledger.latest.items() if entry.get("file")}
    if not files:
        return names
    held, kept = {name.lower() for name in files.values()}, {}
    for row in rows:
        name = files.get(row.request.id)
        if name is not None and name.rpartition(".")[2] != names[row.index].rpartition(".")[2]:
            name = None   # made in another format (a changed row): its new file is another
        if name is None:
            name, n, extension = names[row.index], 1, names[row.index].rpartition(".")[2]
            while name.lower() in held:
                n += 1
                name = f"{sanitize_id(row.request.id)}_{n}.{extension}"
        held.add(name.lower())
        kept[row.index] = name
    return kept


def plan_row(row: ManifestRow, name: str, settings: JobSettings) -> RowPlan:
    params = row_params(row.request, settings.audio_settings())
    return RowPlan(row, name, params, params_key(params), settings.model_fingerprint)


def same_output(old: dict, new: dict, ignored: tuple[str, ...] = ()) -> bool:
    """Settings that differ only where the output does not: in settings the checkpoint ignores, and in
    segment_chars where the text is no longer than either limit (one segment under both). Judged from
    the limit the ledger recorded, not by splitting the text again: the ledger keeps no cuts, and the
    splitter that made them may have cut otherwise than today's."""
    differ = {name for name in old.keys() | new.keys() if old.get(name) != new.get(name)} - set(ignored)
    if differ - {"segment_chars"}:
        return False
    return not differ or len(new["text"]) <= min(old["segment_chars"], new["segment_chars"])


def _rows_to_do(plans: list[RowPlan], ledger: Ledger, out_dir: Path, settings: JobSettings
                ) -> tuple[list[RowPlan], int, list[ManifestRow], list[RowPlan], list[tuple[RowPlan, str]]]:
    """The rows to synthesize, how many are done already, which of those have a reference file that
    cannot be used now (done if an earlier run made them with the same settings otherwise, and with
    the same file where its bytes were read: their plans have its hash, else none; else they fail
    with their problem, or stop the run as changed rows), the rows to synthesize again
    over their earlier file, and the rows made before with the same text and settings whose file is
    there but not whole (emptied or cut since: made again), with the file's name. Raises TTSError
    for rows done before with other text or settings, unless settings.redo_changed."""
    todo, changed, resumed, kept, damaged = [], [], 0, [], []
    for plan in plans:
        entry = ledger.latest.get(plan.row.request.id)
        done = entry is not None and entry["status"] == "ok" and output_exists(out_dir, entry)
        if done and entry.get("model_fingerprint") not in (None, plan.model_fingerprint):
            changed.append((plan, entry))   # another checkpoint in the folder the row was made with
            todo.append(plan)
            continue
        if plan.row.reference_unreadable:   # (kept only whole: it cannot be made again)
            made_with, sha256 = (entry.get("params", {}) if done else {}), plan.params.get("ref_audio_sha256")
            if done and {**made_with, "ref_audio_sha256": None} == {**plan.params, "ref_audio_sha256": None}:
                if sha256 in (None, made_with.get("ref_audio_sha256")):   # unread, or the bytes it was made with
                    if output_intact(out_dir, entry):
                        resumed += 1
                        kept.append(plan.row)
                elif not settings.redo_changed:   # another file there now (with --redo-changed: it fails)
                    changed.append((plan, entry))
            continue
        if done and (entry["key"] == plan.key or same_output(entry.get("params", {}), plan.params,
                                                                 settings.ignored_params)):
            if output_intact(out_dir, entry):
                resumed += 1
                continue
            damaged.append((plan, entry["file"]))
        elif done:
            changed.append((plan, entry))
        todo.append(plan)
    if changed and not settings.redo_changed:
        plan, entry = changed[0]
        raise TTSError(
            f"{out_dir}: {len(changed)} rows were made before with other text or settings (first: row "
            f"{plan.row.number}, id {plan.row.request.id!r}: "
            f"{changed_params(entry.get('params', {}), plan.params) or 'the checkpoint in the model folder'}); "
            + ("use a new --out (a row cannot be taken out of a parquet shard)" if settings.output_format == "parquet"
               else "use a new --out, or --redo-changed to synthesize them again here"))
    if changed and settings.output_format == "parquet":
        raise TTSError("--redo-changed works with --format wav and flac only: a row cannot be taken out of a "
                       "parquet shard; use a new --out")
    return todo, resumed, kept, [plan for plan, _ in changed], damaged


def _synthesize(todo: list[RowPlan], executor: Executor, ledger: Ledger, out_dir: Path, settings: JobSettings,
                notes: list[str], on_rows_done: Callable[[list[RowRecord]], None],
                on_output: OutputCallback | None = None) -> None:
    sink = make_sink(settings.output_format, out_dir, executor.sample_rate, ledger.named_files)
    batches, stopped = synthesize_plans(todo, executor, settings), None
    with ThreadPoolExecutor(WRITER_THREADS, thread_name_prefix="tts-writer") as writers:
        while True:
            try:   # after a stop, the executor yields the rows it has in hand, then ends
                finished = next(batches, None)
            except RunStopped as e:
                stopped, finished = e, None
            except TTSError:
                raise
            except Exception as e:   # a bug or a device fault: the rows made so far are kept, then the run stops
                log.error("synthesis failed", exc_info=True)
                stopped, finished = RunCannotGoOn(f"synthesis failed ({type(e).__name__}: {e}; `tts -v synth ...` "
                                                  "shows where)"), None
            if finished is None:
                break
            failed, records = [], []
            entries, output_error = _store_rows(finished, sink, writers)
            for (plan, audio), entry in zip(finished, entries):
                if entry is None:   # its output could not be written: no ledger line, the run stops below
                    continue
                records.append(_record(plan.row, entry))
                if entry["status"] == "failed":
                    failed.append(entry)
                elif on_output:
                    written = plan.name if settings.output_format != "parquet" else None
                    on_output(replace(records[-1], file=written), audio, sink.sample_rate)
            ledger.append(failed)   # before the shard that durable_entries may write fails
            ledger.append(sink.durable_entries())
            on_rows_done(records)
            if output_error is not None:   # the rows written before it are recorded (above), then the run stops
                raise output_error
    ledger.append(sink.durable_entries(final=True))   # after a stop too: the rows finished before it are kept
    if stopped is None and (signum := stop_signal()) is not None:   # (also one that came as the last rows were written)
        stopped = RunStopped(signum)
    notes += getattr(executor, "notes", [])
    if getattr(executor, "limit", None) and executor.limit.shrinks:
        notes.append(f"out of memory {executor.limit.shrinks} times: rows per call went down to {executor.limit.rows}")
    if stopped is not None:
        raise stopped


def synthesize_plans(plans: list[RowPlan], executor: Executor,
                     settings: JobSettings) -> Iterator[list[tuple[RowPlan, np.ndarray | str]]]:
    """Rows in, finished rows out: each yielded list holds (row, its joined audio or why it failed)
    for the rows finished by one batch; rows the executor refuses come first, in a list of their own.
    A row's segments are spread over the batches like any other requests. Every row is prepared
    (its reference encoded) before the first batch goes out."""
    fade = crossfade_samples(executor.sample_rate)
    items: list[tuple[RowPlan, int]] = []     # (row, segment index) for each request, in batch order
    refused = []
    with stops_here():   # encoding references: nothing is finished yet, so a stop may cut it anywhere
        for plan in plans:
            try:
                request = executor.prepare(plan.row.request)
            except RequestError as e:
                refused.append((plan, str(e)))
                continue
            plan.segments = segment_requests(request, settings.segment_chars)
            plan.outcomes = [None] * len(plan.segments)
            items += [(plan, k) for k in range(len(plan.segments))]
    if refused:
        yield refused
    batches = [items[i:i + settings.batch_size] for i in range(0, len(items), settings.batch_size)]
    for index, outcomes, seconds in executor.run([[plan.segments[k] for plan, k in batch] for batch in batches]):
        touched = {}
        for position, outcome in outcomes:
            plan, k = batches[index][position]
            plan.outcomes[k] = outcome
            plan.batch_seconds[index] = seconds
            touched[id(plan)] = plan
        finished = [(plan, _joined_audio(plan, fade)) for plan in sorted(touched.values(), key=lambda p: p.row.index)
                    if all(outcome is not None for outcome in plan.outcomes)]
        if finished or not outcomes:   # (none: the executor's NO_OUTCOMES, passed on)
            yield finished


def _joined_audio(plan: RowPlan, fade_samples: int) -> np.ndarray | str:
    """The row's segments joined, or the first segment error (naming the segment of a split row)."""
    for k, outcome in enumerate(plan.outcomes):
        if isinstance(outcome, TTSError):
            return (f"segment {k + 1}/{len(plan.outcomes)}: {outcome}" if len(plan.outcomes) > 1 else str(outcome))
    audio = join_with_crossfade([o.audio for o in plan.outcomes], fade_samples)
    if not np.isfinite(audio).all():   # a WAV would hold it as silence or clipping, FLAC refuses it
        return "its audio has NaN or infinite samples (the model's numbers overflowed)"
    return audio


def _store_rows(finished: list[tuple[RowPlan, np.ndarray | str]], sink,
                writers: ThreadPoolExecutor) -> tuple[list[dict | None], OutputError | None]:
    """Each finished row's entry, in order: failed, or ok after its audio went to the sink (which
    hands the entry to the ledger once the output is durable), or None where the output could not
    be written (disk full, I/O error: not the row's fault), with the first such error. The rows are
    encoded and written by the writer threads at once: one after the other (~3 ms to write and fsync
    a WAV), they kept the GPU idle for 1.3-1.7 s per 512 rows on the H200's host (docs/bench.md)."""
    stored = [None if isinstance(audio, str) else writers.submit(sink.store, plan.name, audio)
              for plan, audio in finished]
    entries, output_error = [], None
    for (plan, audio), result in zip(finished, stored):
        if result is None:
            entries.append(_entry(plan, error=audio))
            continue
        try:
            output = result.result()
        except OutputError as e:
            entries.append(None)
            output_error = output_error or e
            continue
        except OSError as e:
            entries.append(_entry(plan, error=f"cannot write {plan.name}: {e}"))
            continue
        except Exception as e:   # the encoder's own failures (libsndfile's, soundfile's asserts)
            entries.append(_entry(plan, error=f"cannot encode its audio: {type(e).__name__}: {e}"))
            continue
        entries.append(_entry(plan, audio_seconds=len(audio) / sink.sample_rate))
        sink.add(entries[-1], plan.name, output)
    return entries, output_error


def _entry(plan: RowPlan, error: str | None = None, audio_seconds: float | None = None) -> dict:
    segments = [o for o in plan.outcomes if isinstance(o, Segment)] if error is None else []
    return {
        "id": plan.row.request.id, "key": plan.key, "status": "failed" if error else "ok",
        "file": None, "frames": sum(s.frames for s in segments) if segments else None,
        "segment_frames": [s.frames for s in segments] if len(segments) > 1 else None,
        "audio_seconds": audio_seconds, "wall_seconds": plan.wall_seconds,
        "hit_cap": any(s.hit_cap for s in segments) if segments else None,
        "error": error, "params": plan.params, "model_fingerprint": plan.model_fingerprint,
    }


def _record(row: ManifestRow, entry: dict | None) -> RowRecord:
    record = RowRecord(row.request, row_number=row.number)
    if row.problem is not None:
        record.error = row.problem
    elif entry is None:
        record.error = NOT_SYNTHESIZED
    else:
        for name in ("file", "frames", "segment_frames", "audio_seconds", "wall_seconds", "hit_cap", "error"):
            setattr(record, name, entry.get(name))
    return record

