"""The Ray Data path, for clusters: `tts synth`'s synthesis as a Ray Data pipeline.

    read_table(manifest) -> row indexes -> from_arrow -> map_batches(SynthesizerActor, fixed actor pool, a GPU each)
                                                 -> write_parquet(out)

Each actor loads the synthesizer once and runs the same code as `tts synth` on its batches (row
checks, long-text segments, out-of-memory recovery, crossfade joins). The output shards have the
columns of `tts synth --format parquet` (audio as a `datasets` Audio struct of FLAC bytes) plus
`frames` and `error` (null audio for a failed row). Ray Data schedules, retries tasks whose
worker or node failed, and writes; an error of synthesis itself (a bug, a device fault) fails its
block's rows, with the error, and the others are kept. There is no ledger: rerun into a fresh output
folder (one that holds anything is refused). This process reads the manifest (its text, no audio), refuses it where a
seed is not an integer (naming the row, as tts synth does), gives each row its index in it and finds the ids that rows
repeat, before the rows are split into batches: the actors then name a row without an `id` by its row number, seed a
row without a `seed` with base_seed + its index, and fail a duplicate id naming the first row with it, as tts synth
does, whichever batch a row is in. A row's audio path is its sanitized id, with a hash of the id where sanitizing
changed it.

Voice cloning (a Base checkpoint, `ref_audio` rows): every actor must read the reference files
(relative paths start from the manifest's folder; a row with one fails where the manifest is remote, a URI
other than file://); each actor encodes each distinct reference once,
into a temporary folder of its own, as `tts synth` does into OUT/.references. The voice arguments
go through tts synth's check of its voice options (tts_cli/voice/checks.py) before Ray reads a row.

Needs the `ray` extra: pip install -e '.[ray]' in the checkout. See README, "Scale-out".
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

from ..errors import TTSError
from ..manifest import (DEFAULT_MAX_TEXT_CHARS, PARQUET_COLUMNS, RowDefaults, check_references, check_schema,
                        check_seeds, default_reference_path, mark_duplicate_ids, repeated_ids, rows_from_table)
from ..output.writer import sanitize_id

log = logging.getLogger(__name__)

# A row's index in the manifest, for the actors: a batch does not know where its rows were. No manifest column has
# this name, and the columns tts does not read are left out of the blocks (read_manifest_table).
ROW_INDEX = "row_index"


def synthesize_with_ray(manifest: str | Path, out_dir: str | Path, *, model_dir: str | Path, actors: int = 1,
                        gpus_per_actor: float = 0, device: str = "cpu", rows_per_batch: int = 64,
                        segments_per_call: int = 8, speaker: str | None = None, language: str = "auto",
                        base_seed: int = 0, greedy: bool = False, max_frames: int | None = None,
                        segment_chars: int = 300, max_text_chars: int = DEFAULT_MAX_TEXT_CHARS,
                        ref_audio: str | None = None, ref_text: str | None = None,
                        x_vector_only: bool = False) -> None:
    """Synthesize a parquet manifest (a file, a folder or a URI that pyarrow.parquet.read_table reads, in this
    process) into parquet shards in out_dir, on the Ray cluster this process is connected to (ray.init first). On
    GPUs: device="cuda" and gpus_per_actor=1, with one actor per GPU. speaker: of the rows that name none (default:
    vivian on a CustomVoice checkpoint, none on Base and VoiceDesign ones). ref_audio, ref_text, x_vector_only: the
    voice of the rows that name none (tts synth's --ref-audio, --ref-text, --x-vector-only); ref_audio relative to
    the working folder, and a blank one none, as tts synth reads them. Local paths (manifest, out_dir, model_dir,
    ref_audio) start from this process's working folder, not the actors'. Voice arguments that its rows cannot take
    raise TTSError before the manifest is read: tts synth's check of its voice options; so do counts below 1
    (actors ... max_frames)."""
    import ray.data

    from ..checkpoint import CUSTOM_VOICE, open_checkpoint
    from ..voice.checks import check_voice_options

    # tts synth's bounds of the same options, checked before an actor loads: there, a segments_per_call or
    # segment_chars of 0 failed every row, and a max_frames of 0 made every row's audio empty
    for name, value in (("actors", actors), ("rows_per_batch", rows_per_batch),
                        ("segments_per_call", segments_per_call), ("segment_chars", segment_chars),
                        ("max_text_chars", max_text_chars), ("max_frames", max_frames)):
        if value is not None and value < 1:
            raise TTSError(f"{name}: expected 1 or more, got {value!r}")
    cfg = open_checkpoint(model_dir).config
    # Here, not in each row once the actors have loaded the model. The keyword arguments have the
    # manifest columns' names, so the messages name them as they are.
    check_voice_options(cfg, speaker, language, None, ref_audio, ref_text, x_vector_only,
                        given_by=lambda setting: setting, max_text_chars=max_text_chars)
    if speaker is None and cfg.model_type == CUSTOM_VOICE:
        speaker = "vivian"
    ref_audio = default_reference_path(ref_audio)   # absolute: the actors' working folder may be another
    # The same for the other local paths, which Ray's tasks and the actors took from their own working folder:
    # a relative out_dir's shards went there, leaving out_dir empty.
    manifest, out_dir, model_dir = (path if "://" in str(path) else os.path.abspath(path)
                                    for path in (manifest, out_dir, model_dir))

    check_fresh_folder(out_dir)

    table = read_manifest_table(str(manifest))
    # A block per batch: the actors share out blocks, and the manifest as one block would go to one actor.
    dataset = ray.data.from_arrow([table.slice(start, rows_per_batch)
                                   for start in range(0, table.num_rows, rows_per_batch)])
    dataset.map_batches(
        SynthesizerActor, batch_size=rows_per_batch, batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=actors), num_gpus=gpus_per_actor or None,
        fn_constructor_kwargs=dict(
            model_dir=str(model_dir), device=device,
            defaults=RowDefaults(speaker, language, base_seed, max_text_chars, ref_audio=ref_audio, ref_text=ref_text,
                                 x_vector_only=x_vector_only, max_text_chars_name="max_text_chars"),
            greedy=greedy, max_frames=max_frames, segment_chars=segment_chars, segments_per_call=segments_per_call,
            references_base=references_folder(str(manifest)), repeated_ids=repeated_ids(table)),
    ).write_parquet(str(out_dir))


def references_folder(manifest: str) -> str | None:
    """The local folder a manifest's relative ref_audio cells start from: the manifest's own, or the manifest where it
    is a folder of parquet files; None behind a URI other than file://, whose folder the actors cannot read reference
    files from (they read local files only), so that such a row fails, saying so."""
    if "://" in manifest:
        uri = urllib.parse.urlparse(manifest)
        if uri.scheme != "file":
            return None
        manifest = urllib.request.url2pathname(uri.path)
    return manifest if os.path.isdir(manifest) else os.path.dirname(manifest)


def read_manifest_table(manifest: str):
    """The manifest's columns that tts reads (PARQUET_COLUMNS), and each row's index in it (ROW_INDEX); raises
    TTSError naming the manifest where pyarrow cannot read it, check_schema refuses it, it has no rows, or a seed that
    is not an integer (naming its row), as tts synth does."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(manifest)
    except Exception as e:  # pyarrow raises several unrelated types for a bad file
        raise TTSError(f"{manifest}: cannot read as parquet: {e}") from e
    check_schema(table.schema, manifest)
    # Here, with the whole table: an actor, seeing a batch, could only fail the row or the run once Ray reached it
    check_seeds(table, manifest)
    if not table.num_rows:   # Ray would write no shard, and the run would look done
        raise TTSError(f"{manifest}: no rows")
    table = table.select([name for name in table.column_names if name in PARQUET_COLUMNS])
    return table.append_column(ROW_INDEX, pa.array(range(table.num_rows), pa.int64()))


def check_fresh_folder(out_dir: str) -> None:
    """Raises TTSError where out_dir holds anything: Ray adds its shards beside an earlier run's, which a reader
    of the folder then takes for one dataset, each row twice (there is no ledger to resume from)."""
    from pyarrow import fs

    try:
        filesystem, path = fs.FileSystem.from_uri(out_dir)
        found = filesystem.get_file_info(fs.FileSelector(path, allow_not_found=True))
    except OSError as e:   # a file, a folder it may not read
        raise TTSError(f"cannot use {out_dir} as the output folder: {e}") from e
    if found:
        raise TTSError(f"{out_dir} holds {found[0].base_name}{f' and {len(found) - 1} more' if len(found) > 1 else ''}"
                       ": the Ray path does not resume (no ledger), and its shards beside those would repeat their "
                       "rows; give a fresh or empty folder")


def output_name(row_id: str) -> str:
    """A row's audio path in its shard: its sanitized id, with a hash of the id where sanitizing
    changed it (blocks cannot number collisions as tts synth does: 'a b' and 'a_b' would share it)."""
    name = sanitize_id(row_id)
    if name != row_id:
        name += "-" + hashlib.sha256(row_id.encode("utf-8")).hexdigest()[:8]
    return f"{name}.flac"


class SynthesizerActor:
    """One per actor of the pool: a loaded synthesizer, called on pyarrow batches of manifest rows."""

    def __init__(self, model_dir: str, device: str, defaults: RowDefaults, greedy: bool, max_frames: int | None,
                 segment_chars: int, segments_per_call: int, references_base: str | None,
                 repeated_ids: dict[str, int]):
        from ..job import JobSettings, LocalExecutor
        from ..synthesizer import Synthesizer, allow_tf32
        from ..voice.voices import Voices

        if device.startswith("cuda"):
            allow_tf32()
        self.defaults, self.repeated_ids = defaults, repeated_ids
        self.references_base = None if references_base is None else Path(references_base)
        self.settings = JobSettings(output_format="parquet", greedy=greedy, max_frames=max_frames,
                                    segment_chars=segment_chars, batch_size=segments_per_call, model=model_dir)
        self.references = tempfile.TemporaryDirectory(prefix="tts-references-")   # removed with the actor
        self.executor = LocalExecutor(Synthesizer.from_pretrained(model_dir, device=device), self.settings,
                                      voices=Voices(Path(model_dir), Path(self.references.name), device))

    def __call__(self, batch):
        import pyarrow as pa

        from ..job import plan_row, synthesize_plans
        from ..output.formats import shard_schema
        from ..output.writer import encode_audio

        rows = rows_from_table(batch, self.defaults, "a Ray batch", base_dir=self.references_base,
                               indexes=batch.column(ROW_INDEX).to_pylist())
        mark_duplicate_ids(rows, self.repeated_ids)
        check_references(rows)
        plans = [plan_row(row, output_name(row.request.id), self.settings) for row in rows if not row.problem]
        try:
            outcomes = {id(plan.row): (plan, audio) for finished in synthesize_plans(plans, self.executor,
                                                                                    self.settings)
                        for plan, audio in finished}
        except TTSError:
            raise
        except Exception as e:   # a bug or a device fault: this block's rows fail with it, the others are kept
            log.error("synthesis failed on a block", exc_info=True)
            outcomes = {id(plan.row): (plan, f"synthesis failed: {type(e).__name__}: {e}") for plan in plans}
        rate = self.executor.sample_rate
        table = []
        for row in rows:
            plan, audio = outcomes.get(id(row), (None, row.problem))
            ok = not isinstance(audio, str)
            table.append({
                "id": row.request.id, "text": row.request.text, "speaker": row.request.speaker,
                "language": row.request.language,
                "audio": {"bytes": encode_audio(audio, rate), "path": plan.name} if ok else None,
                "sampling_rate": rate, "duration": len(audio) / rate if ok else None,
                "frames": sum(o.frames for o in plan.outcomes) if ok else None, "error": None if ok else audio,
            })
        schema = shard_schema(rate).append(pa.field("frames", pa.int64())).append(pa.field("error", pa.string()))
        return pa.Table.from_pylist(table, schema=schema)

