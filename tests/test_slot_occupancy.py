"""tools/slot_occupancy.py's step model against the engine itself (the bundled tiny model on CPU):
the same steps, frames and admissions for the bench's queue and for it longest first, and the step counts of the
H200 runs in bench/results."""
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from slot_occupancy import bench_lengths, packed_tiles, prompt_positions, simulate  # noqa: E402

from tts_cli.bench import make_requests, read_sentences  # noqa: E402
from tts_cli.cli import BUNDLED_MODEL_DIR  # noqa: E402
from tts_cli.engine.runner import Engine  # noqa: E402
from tts_cli.synthesizer import Synthesizer, code_predictor_settings, longest_first, talker_settings  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


@pytest.mark.parametrize("rows,count,window,tail_rows", [(4, 13, 4, ()), (1, 3, 16, ()), (8, 24, 4, (4, 2))])
def test_the_model_takes_the_engines_steps(rows, count, window, tail_rows):
    synth = Synthesizer.from_pretrained(BUNDLED_MODEL_DIR)
    requests = make_requests(synth, read_sentences(), count, None, "vivian")
    assert [r.max_frames for r in requests] == bench_lengths(count)
    sampling = synth.ckpt.sampling
    for queue in (requests, longest_first(requests)):
        engine = Engine(synth.model, synth.codec, rows=rows, context=128, talker_defaults=talker_settings(sampling),
                        cp_defaults=code_predictor_settings(sampling), codec_window=window, tail_rows=tail_rows)
        admissions, prefill = [], engine._prefill
        engine._prefill = lambda admitted: (admissions.append(len(admitted)), prefill(admitted))[1]
        with torch.no_grad():
            results = engine.run(queue)
        model = simulate([r.max_frames for r in queue], rows, window, halve_to=tail_rows[-1] if tail_rows else None)
        assert model["admissions"] == admissions
        assert model["steps"] == engine.stats.steps
        assert model["graph_steps"] == engine.stats.steps_by_rows
        assert model["frames"] == sum(len(r.codes) for r in results)


def test_the_model_takes_the_steps_of_the_h200_runs():
    run = json.loads((RESULTS / "bench-1.7b-c256-c512-2048-requests-h200-2026-12-03.json").read_text())
    for level in run["rows"]:
        model = simulate(bench_lengths(level["requests"]), level["concurrency"])
        assert model["steps"] == level["steps"]
        assert round(model["busy"], 3) == level["slots_busy"]


def test_tail_steps_count_their_rows_and_change_no_step():
    """simulate's halve_to (the engine's tail steps): once the queue is empty the slots still speaking
    run, from the next window boundary, in the smallest halved step that holds them, so the same
    steps and frames count fewer slot-steps."""
    lengths = [20] + [2] * 7          # one long request; the others end in the first window
    plain = simulate(lengths, 8)
    halved = simulate(lengths, 8, halve_to=2)
    assert (halved["steps"], halved["frames"]) == (plain["steps"], plain["frames"]) == (20, 34)
    assert plain["graph_steps"] == {8: 20}
    # the host reads the short ones' stops at the first boundary (after 4 steps); then one slot is
    # held: 8 -> 4 -> 2 at once, not below halve_to
    assert halved["graph_steps"] == {8: 4, 2: 16}
    assert halved["busy"] == 34 / (8 * 4 + 2 * 16) > plain["busy"] == 34 / (8 * 20)
    assert simulate(lengths, 8, halve_to=4)["graph_steps"] == {8: 4, 4: 16}
    assert simulate(lengths, 8, halve_to=8) == plain


def test_admission_at_every_step_knows_stops_one_step_late_and_a_lagged_codec_waits_for_its_windows():
    """Two slots, K = 4; slot 0 speaks 30 frames, slot 1 takes requests of 1, 5 and 2. Frame 0 ends the
    first; its flags are read after step 1 is launched, so every-step admission starts the second at
    step 2 (with each step's flags awaited, at 1; at boundaries only, at 4). The second ends at step 6;
    the boundary at 8 has read that, and the third starts there, or, with the second decoded 2 frames
    late (admitted at column 2), at 9: its last frame falls in codec window 2 (steps 8-11 less the lag),
    so the third's first codec window must be 3."""
    lengths = [30, 1, 5, 2]
    assert simulate(lengths, 2)["starts"] == [0, 0, 4, 12]
    assert simulate(lengths, 2, admit_every=1)["starts"] == [0, 0, 2, 8]
    assert simulate(lengths, 2, admit_every=1, flags_awaited=True)["starts"] == [0, 0, 1, 6]
    assert simulate(lengths, 2, admit_every=1, codec_lag=True)["starts"] == [0, 0, 2, 9]
    assert simulate(lengths, 2, admit_every=1, codec_lag=True, flags_awaited=True)["starts"] == [0, 0, 1, 9]


def test_packed_tiles_are_the_engines_per_admission_and_round():
    """At 512 slots (tiles of 256 to 2048 tokens), request k takes positions[k % 4]: admission one's
    20, 30, 18 positions (68) fill one tile of 256; admission two's 40 and 20 two, the 40's last 8 in a
    second round. Less 8 shared positions: 44 and 44 (the 32 in one round), one tile each."""
    assert packed_tiles([3, 2], [20, 30, 18, 40], 0, 512) == (128, 3 * 256, 3)
    assert packed_tiles([3, 2], [20, 30, 18, 40], 8, 512) == (88, 2 * 256, 2)


def test_the_bench_prompts_share_their_first_8_positions():
    """The bench's CustomVoice prompts (vivian) of the 360 bundled sentences: 18-30 positions, of which
    the first 8 (the assistant turn's opening, the think tokens, the speaker, tts_bos) are the same."""
    positions, shared = prompt_positions()
    assert len(positions) == 360 and (min(positions), max(positions), shared) == (18, 30, 8)


def test_tail_min_rows_is_a_rule_to_try(monkeypatch, capsys):
    """--tail-min-rows: the same work with tail steps down to fewer rows than the engine's 128 keeps
    more of c256's slot-steps busy (its default prints the engine's 85.0%)."""
    import slot_occupancy
    busy = {}
    for rows in (128, 64):
        monkeypatch.setattr(sys, "argv", ["slot_occupancy.py", "--concurrency", "256", "--tail-min-rows", str(rows)])
        slot_occupancy.main()
        busy[rows] = capsys.readouterr().out.splitlines()[2].split(" | ")[3]
    assert busy == {128: "85.0%", 64: "89.9%"}
