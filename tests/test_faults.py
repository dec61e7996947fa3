"""GPU faults: an injected CUDA out-of-memory during a decoding step is survived by fewer rows per
call; a row that runs out of memory even alone fails with the error; nothing already made is lost."""
import errno
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tts_cli import cli
from tts_cli.faults import out_of_memory_in
from tts_cli.job import RowLimit, Segment, synthesize_batch
from tts_cli.request import Request

from fakes import use_fake_synthesizer

runner = CliRunner()


@pytest.fixture(scope="module")
def bundled():
    from tts_cli.synthesizer import Synthesizer

    return Synthesizer.from_pretrained(cli.BUNDLED_MODEL_DIR)


def _outcomes(synth, requests, **options) -> list:
    """synthesize_batch's outcomes, in request order."""
    found = {}
    synthesize_batch(synth, requests, on_outcome=found.__setitem__, **options)
    return [found[position] for position in range(len(requests))]


def test_out_of_memory_mid_generation_halves_the_rows_and_gives_the_same_audio(bundled):
    requests = [Request(f"r{i}", text, "vivian", seed=i) for i, text in enumerate(
        ["Hello there.", "The birch canoe slid.", "Rice is often served.", "Four."])]
    clean = _outcomes(bundled, requests, greedy=False, max_frames=5, limit=RowLimit(4))

    limit = RowLimit(4)
    # after_calls=2: the prefill and the first step pass, the second decoding step of the 4-row batch fails.
    with out_of_memory_in(bundled.model.talker, min_rows=3, after_calls=2) as injected:
        survived = _outcomes(bundled, requests, greedy=False, max_frames=5, limit=limit)
    assert injected["raised"] == 1
    assert (limit.rows, limit.shrinks) == (2, 1)
    assert all(isinstance(o, Segment) for o in survived)
    for a, b in zip(clean, survived):
        assert a.frames == b.frames and np.array_equal(a.audio, b.audio)   # rows do not depend on their batch


def test_a_row_out_of_memory_even_alone_fails_and_the_others_are_kept(bundled):
    requests = [Request("a", "Hello.", "vivian"), Request("b", "Again.", "vivian")]
    with out_of_memory_in(bundled.model.talker, min_rows=1, after_calls=0) as injected:
        outcomes = _outcomes(bundled, requests, greedy=True, max_frames=3, limit=RowLimit(2))
    assert injected["raised"] == 1 + 2 * 2   # the pair, then each row twice alone
    assert all("out of GPU memory even alone (2 tries): CUDA out of memory (injected on 1 rows)" in str(o)
               for o in outcomes)


def test_an_engine_that_ran_out_of_memory_is_built_anew_for_the_retry(bundled):
    """Through the engine (2 slots, calls of 4 rows), an out-of-memory in the first call's prefill: the
    retry (calls of 2) builds a new engine instead of keeping the one that failed, whose memory its
    choice of slots and positions must count as free (kept, it left `--rows auto` 64 slots on an
    H100, 2026-12-06), and every row gets the audio of a run without the fault."""
    from tts_cli.synthesizer import Synthesizer

    synth = Synthesizer.from_pretrained(cli.BUNDLED_MODEL_DIR, engine=True, engine_rows=2)
    requests = [Request(f"r{i}", text, "vivian", seed=i) for i, text in enumerate(
        ["Hello there.", "The birch canoe slid.", "Rice is often served.", "Four."])]
    clean = _outcomes(synth, requests, greedy=False, max_frames=5, limit=RowLimit(4))
    failed = synth._engine_now
    limit = RowLimit(4)
    with out_of_memory_in(synth.model.talker.decoder, min_rows=1, times=1) as injected:
        survived = _outcomes(synth, requests, greedy=False, max_frames=5, limit=limit)
    assert injected["raised"] == 1 and (limit.rows, limit.shrinks) == (2, 1)
    assert synth._engine_now is not failed and synth._engine_now.rows == 2
    for a, b in zip(clean, survived):
        assert a.frames == b.frames and np.array_equal(a.audio, b.audio)


def _synth_fake(tmp_path, rows: str, batch_size: int):
    """`tts synth` of the manifest lines `rows` on the fake synthesizer; (the CLI's result, its --out)."""
    manifest, out = tmp_path / "m.txt", tmp_path / "out"
    manifest.write_text(rows)
    return runner.invoke(cli.app, ["synth", str(manifest), "--out", str(out), "--model", str(tmp_path / "model"),
                                   "--batch-size", str(batch_size)]), out


def test_out_of_memory_through_the_cli_fails_only_the_row_at_fault(monkeypatch, tmp_path):
    fake = use_fake_synthesizer(monkeypatch, tmp_path)
    result, out = _synth_fake(tmp_path, "a\tOne.\nb\tTwo.\nc\tThree oom-shared.\nd\tFour.\ne\tFive oom-always.\n"
                                        "f\tSix.\n", batch_size=4)
    assert result.exit_code == 1, result.output
    report = json.loads((out / "report.json").read_text())
    errors = {row["id"]: row["error"] for row in report["rows"]}
    assert errors == {"a": None, "b": None, "c": None, "d": None, "f": None,
                      "e": "out of GPU memory even alone (2 tries): CUDA out of memory (fake)"}
    assert all((out / f"{row_id}.wav").is_file() for row_id in "abcdf")
    # 4 rows fail, then 2 at a time: a+b pass, c+d fail, then c and d alone, then e twice and f.
    assert fake.batches == [["a", "b", "c", "d"], ["a", "b"], ["c", "d"], ["c"], ["d"], ["e"], ["e"], ["f"]]
    assert fake.max_rows == [4, 2, 2, 1, 1, 1, 1, 1]   # the engine's slots shrink with the calls
    assert "rows per call went down to 1" in " ".join(report["notes"])


def test_host_memory_running_out_is_survived_like_gpu_memory(monkeypatch, tmp_path):
    """A lockstep batch on CPU whose masks do not fit in host memory (a very long prompt) is retried
    with fewer rows; any other error is not taken for one."""
    from tts_cli.job import exhausted_memory

    fake = use_fake_synthesizer(monkeypatch, tmp_path)
    result, out = _synth_fake(tmp_path, "a\tOne.\nb\tTwo host-oom.\nc\tThree.\n", batch_size=3)
    assert result.exit_code == 0, result.output
    assert fake.batches == [["a", "b", "c"], ["a"], ["b"], ["c"]]
    report = json.loads((out / "report.json").read_text())
    assert [row["error"] for row in report["rows"]] == [None] * 3
    assert "out of memory 1 times: rows per call went down to 1" in report["notes"]
    with pytest.raises(RuntimeError) as real:
        torch.empty(1 << 50)   # 4 PiB: torch's own message, which exhausted_memory reads
    assert exhausted_memory(real.value) == "host"
    assert exhausted_memory(RuntimeError("shape mismatch")) is None


@pytest.mark.parametrize("batch_size, recorded", [("1", ["r0", "r1", "r2", "r3"]),
                                                  ("8", ["r0", "r1", "r2", "r3", "r5", "r6", "r7"])])
def test_no_space_for_a_file_stops_the_run_and_a_rerun_resumes(monkeypatch, tmp_path, batch_size, recorded):
    """ENOSPC from the OS, half-way through r4's file (where a tmpfs cannot be mounted,
    tests/test_signals.py cannot run this for real): exit 2 naming the path, no partial file, no
    ledger line for r4 or the rows not synthesized. One row per batch: r0-r3 are recorded. Eight per
    batch: they are written at once, and the batch's others, whose files are on disk, are recorded
    too (the rerun made them again before). The same command then finishes with each row once."""
    use_fake_synthesizer(monkeypatch, tmp_path)
    real_write_bytes = Path.write_bytes

    def write_bytes(path, data):
        if ".r4.wav." in path.name and not (tmp_path / "full-once").exists():
            (tmp_path / "full-once").write_text("")
            real_write_bytes(path, data[:len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write_bytes(path, data)

    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    manifest, out = tmp_path / "m.txt", tmp_path / "out"
    manifest.write_text("".join(f"r{i}\tRow {i}.\n" for i in range(8)))
    arguments = ["synth", str(manifest), "--out", str(out), "--model", str(tmp_path / "model"),
                 "--batch-size", batch_size]
    full = runner.invoke(cli.app, arguments)
    assert full.exit_code == 2, full.output
    assert f"error: cannot write {out / 'r4.wav'}: No space left on device; the run stopped" in full.stderr
    assert [e["id"] for e in map(json.loads, (out / "ledger.jsonl").read_text().splitlines())] == recorded
    assert sorted(p.name for p in out.iterdir()) == [".tts-lock", "ledger.jsonl", *(f"{r}.wav" for r in recorded)]

    rerun = runner.invoke(cli.app, arguments)
    assert rerun.exit_code == 0, rerun.output
    assert f"8 rows ok ({len(recorded)} from an earlier run)" in rerun.stdout
    assert sorted(e["id"] for e in map(json.loads, (out / "ledger.jsonl").read_text().splitlines())) == \
        [f"r{i}" for i in range(8)]


@pytest.mark.parametrize("error, remedy", [
    (PermissionError(errno.EACCES, "Permission denied"), "make the folder writable"),
    (OSError(errno.EROFS, "Read-only file system"), "make the folder writable"),
    (OSError(errno.ENOSPC, "No space left on device"), "free space"),
    (OSError(errno.EIO, "Input/output error"), "fix the folder")])
def test_a_folder_that_cannot_be_written_is_named_with_the_os_reason_and_its_remedy(monkeypatch, tmp_path,
                                                                                    error, remedy):
    """An --out that refuses writes (its lock cannot be made: where the tests run as root, a folder chmod'ed
    read-only is written all the same, so os.open refuses here) is told apart from a full disk: no advice
    to free space where permissions stand in the way."""
    import os
    import types

    from tts_cli.output import ledger as ledger_module

    use_fake_synthesizer(monkeypatch, tmp_path)

    def refused(path, *args, **kwargs):
        if Path(path).name == ledger_module.LOCK_NAME:
            raise error
        return os.open(path, *args, **kwargs)

    monkeypatch.setattr(ledger_module, "os", types.SimpleNamespace(**{**vars(os), "open": refused}))
    result, out = _synth_fake(tmp_path, "a\tOne.\n", batch_size=1)
    assert result.exit_code == 2, result.output
    assert (f"error: cannot write {out / '.tts-lock'}: {error.strerror}; the run stopped (rows already recorded are "
            f"kept): {remedy}, then rerun the same command to resume") in result.stderr


def test_a_ledger_append_that_fails_leaves_the_ledger_as_it_was(monkeypatch, tmp_path):
    import os
    import types

    from tts_cli.errors import OutputError
    from tts_cli.output import ledger as ledger_module

    with ledger_module.Ledger(tmp_path) as ledger:
        ledger.append([{"id": "a", "key": "k", "status": "ok"}])
        before = (tmp_path / "ledger.jsonl").read_bytes()

        def fsync(fd):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(ledger_module, "os", types.SimpleNamespace(**{**vars(os), "fsync": fsync}))
        with pytest.raises(OutputError, match=f"cannot write {tmp_path / 'ledger.jsonl'}: Input/output error"):
            ledger.append([{"id": "b", "key": "k", "status": "ok"}])
        assert (tmp_path / "ledger.jsonl").read_bytes() == before and list(ledger.latest) == ["a"]
