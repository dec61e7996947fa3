"""The persistent depth kernel: its host-side schedule (plain Python) and, in Triton's interpreter,
its task code against the code predictor's loop. On CPU the interpreter runs one phase per launch
(the launch boundary is the barrier); the GPU run, one launch with counters, is in test_gpu.py."""
import importlib.util
from collections import Counter

import pytest

from test_kernels import _interpret
from tts_kernels import depth_schedule as plan

REAL_1_7B = plan.Shapes(hidden=1024, intermediate=3072, q_heads=16, kv_heads=8, head_dim=128, vocab=2048, layers=5,
                        rows=64)


def _tasks_by_phase(schedule):
    found = Counter()
    for cta, tasks in enumerate(schedule.table):
        for task in tasks:
            found[task[1]] += 1
    return found


def _signallers(schedule):
    """counter -> the (phase, tile) of every task that increments it."""
    found: dict[int, set] = {}
    for tasks in schedule.table:
        for task in tasks:
            found.setdefault(task[7], set()).add((task[1], task[4]))
    return found


def _reads(shapes, kind, tile):
    """The tiles of the phase before that a task of `kind` reads, from the tensors' column layout
    (independently of the schedule's groups); None: all of them."""
    overlap = lambda a, b: a[0] < b[1] and b[0] < a[1]
    hd, per_group = shapes.head_dim, shapes.q_heads // shapes.kv_heads
    if kind == plan.ATTN:   # its kv head's query heads, key and value, every K slice
        h = tile % shapes.kv_heads
        wanted = [(h * per_group * hd, (h + 1) * per_group * hd), ((shapes.q_heads + h) * hd, (shapes.q_heads + h + 1) * hd),
                  ((shapes.q_heads + shapes.kv_heads + h) * hd, (shapes.q_heads + shapes.kv_heads + h + 1) * hd)]
        return {t for t in range(shapes.tasks(plan.QKV))
                if any(overlap((t // shapes.qkv_splits * shapes.qkv_n, (t // shapes.qkv_splits + 1) * shapes.qkv_n), w)
                       for w in wanted)}
    if kind == plan.O:   # its K slice of the attention output: the query heads of some kv groups, every row
        width = shapes.q_heads * hd // shapes.o_splits
        s = tile % shapes.o_splits
        return {t for t in range(shapes.tasks(plan.ATTN))
                if overlap((s * width, (s + 1) * width),
                           (t % shapes.kv_heads * per_group * hd, (t % shapes.kv_heads + 1) * per_group * hd))}
    if kind == plan.DOWN:   # its K slice of silu(gate) * up
        width = shapes.intermediate // shapes.down_splits
        s = tile % shapes.down_splits
        return {t for t in range(shapes.tasks(plan.GATE_UP))
                if overlap((s * width, (s + 1) * width), (t * shapes.gate_up_n, (t + 1) * shapes.gate_up_n))}
    return None


GROUPINGS = {"real": REAL_1_7B, "whole phases": plan.Shapes(**{**REAL_1_7B.__dict__, "group_waits": False}),
             "wide slices": plan.Shapes(**{**REAL_1_7B.__dict__, "o_n": 32, "o_splits": 4, "qkv_n": 256,
                                           "qkv_splits": 8}),
             "16 rows": plan.Shapes(**{**REAL_1_7B.__dict__, "rows": 16, "attn_rows": 1}),
             "wide gate/up tiles": plan.Shapes(**{**REAL_1_7B.__dict__, "gate_up_n": 256}),
             "narrow tiles": plan.Shapes(**{**REAL_1_7B.__dict__, "qkv_n": 32, "qkv_splits": 2, "o_n": 128,
                                            "o_splits": 16})}


@pytest.mark.parametrize("ctas", [132, 7, 1])
@pytest.mark.parametrize("grouping", list(GROUPINGS))
def test_every_task_waits_for_all_it_reads_and_every_wait_is_matched_by_its_signals(grouping, ctas):
    """Each task waits on one counter until the count of the tasks that increment it, all of them
    in the phase before its own; and they include every task whose output it reads: the whole
    phase before, or for attention, o and down (with group_waits) the tiles of their inputs. Every
    tile of every phase runs exactly once."""
    shapes = GROUPINGS[grouping]
    schedule = plan.build(shapes, ctas, sms=132)
    signallers = _signallers(schedule)
    grouped = 0
    for tasks in schedule.table:
        for kind, phase, position, layer, tile, wait_counter, wait_count, signal in tasks:
            if phase == 0:
                assert wait_counter == plan.NO_WAIT
                continue
            waited = signallers[wait_counter]
            assert len(waited) == wait_count and {p for p, _ in waited} == {phase - 1}
            reads = _reads(shapes, kind, tile)
            if reads is None or not shapes.group_waits:
                assert len(waited) == schedule.phases[phase - 1].tasks
            else:
                assert reads <= {t for _, t in waited}
                grouped += len(waited) < schedule.phases[phase - 1].tasks
    # which consumers wait by group: all three in the engine's tiles; none without group_waits; where a
    # slice spans kv groups (4 o slices of 512) or a tile spans heads (256-wide q/k/v tiles) or down
    # slices (256-wide gate/up tiles across slices of 384), the whole phase
    kinds_grouped = {task[0] for tasks in schedule.table for task in tasks
                     if task[5] >= len(schedule.phases) or task[7] >= len(schedule.phases)}
    every = {plan.QKV, plan.ATTN, plan.O, plan.GATE_UP, plan.DOWN}
    assert kinds_grouped == {"real": every, "16 rows": every, "whole phases": set(),
                             "wide slices": {plan.GATE_UP, plan.DOWN},
                             "wide gate/up tiles": {plan.QKV, plan.ATTN, plan.O},
                             "narrow tiles": every}[grouping]
    assert (grouped > 0) == bool(kinds_grouped)
    tiles = Counter((task[1], task[4]) for tasks in schedule.table for task in tasks)
    assert all(count == 1 for count in tiles.values())
    assert len(tiles) == sum(p.tasks for p in schedule.phases)
    assert schedule.counters == len(schedule.phases) + len({task[7] for tasks in schedule.table for task in tasks
                                                            if task[7] >= len(schedule.phases)})


def test_group_waits_wait_for_the_producers_of_their_inputs_alone():
    """In the engine's tiles: an attention task waits for the 16 q/k/v tasks of its kv head (2 query
    heads, its key and value, 4 K slices each), an o task for the 16 attention tasks of its slice's
    kv group, a down task for the 12 gate/up tiles of its slice, instead of 128, 128 and 96."""
    schedule = plan.build(REAL_1_7B, 132, sms=132)
    counts = {kind: {task[6] for tasks in schedule.table for task in tasks if task[0] == kind}
              for kind in (plan.ATTN, plan.O, plan.DOWN, plan.QKV, plan.GATE_UP)}
    assert counts == {plan.ATTN: {16}, plan.O: {16}, plan.DOWN: {12}, plan.QKV: {64}, plan.GATE_UP: {64}}


def test_each_cta_runs_its_tasks_in_phase_order():
    """A CTA waits only on earlier phases and walks them in order, so with every CTA resident the
    frame cannot deadlock."""
    schedule = plan.build(REAL_1_7B, 132, sms=132)
    for tasks in schedule.table:
        phases = [task[1] for task in tasks]
        assert phases == sorted(phases) and len(set(phases)) == len(phases)


def test_the_frame_is_the_loops_sequence_of_steps():
    """16 positions x 5 layers of (qkv, attention, o, norm, gate/up, down, norm), 15 heads, one
    embedding per position and the last draw; the 1.7B tiles cover their projections with 128
    tasks (96 for gate/up, whose silu needs whole sums)."""
    phases = plan.frame_phases(REAL_1_7B)
    kinds = Counter(p.kind for p in phases)
    assert kinds[plan.EMBED] == 17 and kinds[plan.HEAD] == 15
    assert kinds[plan.QKV] == kinds[plan.ATTN] == kinds[plan.GATE_UP] == 16 * 5
    assert kinds[plan.NORM_1] == 16 * 4 + 15 and kinds[plan.NORM_2] == 16 * 5
    assert len(phases) == 591
    assert [REAL_1_7B.tasks(k) for k in (plan.QKV, plan.O, plan.GATE_UP, plan.DOWN, plan.HEAD, plan.ATTN)] == \
        [128, 128, 96, 128, 128, 128]


def test_grids_that_cannot_all_be_resident_or_tiles_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="all must be resident"):
        plan.build(REAL_1_7B, 133, sms=132)
    with pytest.raises(ValueError, match="gate_up: N 3072 by tiles of 40"):
        plan.build(plan.Shapes(**{**REAL_1_7B.__dict__, "gate_up_n": 40}), 132, sms=132)


def test_tiles_shrink_to_fit_small_code_predictors():
    from tts_kernels.depth_frame import shapes_for
    shapes = shapes_for(hidden=16, intermediate=32, q_heads=4, kv_heads=2, head_dim=8, vocab=64, layers=2, rows=5)
    shapes.check()
    assert shapes.rows == 16 and shapes.block_k == 16 and shapes.attn_rows == 1
    assert shapes_for(1024, 3072, 16, 8, 128, 2048, 5, 64) == REAL_1_7B
    # attention tasks: one per CTA, as few rows each as that allows (128 tasks at 8 kv heads)
    assert [shapes_for(1024, 3072, 16, 8, 128, 2048, 5, rows).attn_rows for rows in (1, 16, 17, 64)] == [1, 1, 4, 4]


FRAME_CHECK = """
import dataclasses
import torch
from pathlib import Path
from tts_cli.checkpoint import open_checkpoint
from tts_cli.model.depth import CodePredictor
from tts_cli.model.sampler import RowSampling, SamplerSettings, choose
from tts_kernels.depth_frame import DepthFrame

# the tiny model's code predictor with a 64-code vocabulary (the interpreter's sort of 2048 is slow),
# as 1.7B (the talker is wider than the predictor: inputs projected) and as 0.6B (same widths: none)
tiny = dataclasses.replace(open_checkpoint(Path("tts_cli/assets/tiny-1.7b-customvoice")).config, code_vocab_size=64)
as_06b = dataclasses.replace(tiny, talker=dataclasses.replace(tiny.talker, hidden_size=tiny.code_predictor.hidden_size))


def check(cfg, teacher_forced: bool, tiles=None, rows=5) -> None:
    torch.manual_seed(0)
    cp = CodePredictor(cfg).eval()
    assert isinstance(cp.input_projection, torch.nn.Identity) == (cfg is as_06b)
    with torch.no_grad():
        for name, p in cp.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * 0.3)
    hidden, code0_embed = torch.randn(rows, cfg.talker.hidden_size), torch.randn(rows, cfg.talker.hidden_size)
    settings = [SamplerSettings(do_sample=i % 3 != 0, temperature=[1.0, 0.7, 1.3][i % 3], top_k=[50, 0, 3][i % 3],
                                top_p=1.0) for i in range(rows)]
    sampling = RowSampling.stack(settings, "cpu")
    seeds, frame = torch.randint(0, 2**62, (rows,)), torch.arange(rows) * 7 + 2
    with torch.no_grad():
        codes, logits = cp.predict_frame(hidden, code0_embed,
                                         choose=lambda g, l: choose(l, sampling, seeds, frame, g, top_p=False))
        x_in = cp.input_projection(torch.stack((hidden, code0_embed)))
        kernel = DepthFrame(cp, rows, tiles=tiles)
        got = kernel.run(x_in, sampling.temperature, sampling.top_k, sampling.do_sample, seeds, frame, store_logits=True)
        assert torch.equal(got, codes), (got, codes)
        torch.testing.assert_close(kernel.logits[:rows], logits, rtol=1e-5, atol=1e-5)
        if not teacher_forced:
            return
        # teacher forced, as tts verify-golden and tools/depth_bench.py run it (against the loop on
        # static caches): the kernel takes the given codes and its logits are the loop's
        from tts_cli.engine.depth_check import kernel_against_loop
        forced = torch.randint(0, 64, (rows, 15))
        _, forced_logits = cp.predict_frame(hidden, code0_embed, None, forced_codes=forced)
        result = kernel_against_loop(cp, hidden, code0_embed, forced, kernel)
        assert torch.equal(kernel.codes[:rows], forced)
        torch.testing.assert_close(kernel.logits[:rows], forced_logits, rtol=1e-5, atol=1e-5)
        assert result["logit_error_of_max"] < 1e-5 and result["greedy_agreement"] == 1.0, result


def check_fp16(cfg, tiles=None) -> None:
    # fp16 weights (the engine's default on CUDA): the inputs of every projection rounded to fp16,
    # fp16 caches. Against the loop's fused path (the same roundings; sums in another order).
    from tts_cli.engine.depth_check import kernel_against_loop
    from tts_cli.model.transformer import use_kernels
    torch.manual_seed(1)
    cp = CodePredictor(cfg).eval()
    with torch.no_grad():
        for name, p in cp.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * 0.3)
    cp = cp.half()
    use_kernels(cp, True)
    rows = 3
    hidden, code0_embed = torch.randn(rows, cfg.talker.hidden_size), torch.randn(rows, cfg.talker.hidden_size)
    forced = torch.randint(0, 64, (rows, 15))
    kernel = DepthFrame(cp, rows, tiles=tiles)
    assert kernel.scratch["xn"].dtype == kernel.scratch["k_cache"].dtype == torch.float16
    result = kernel_against_loop(cp, hidden, code0_embed, forced, kernel)
    # measured 1.4e-4 (an fp32 sum in another order, rounded to fp16, moves by one unit at times);
    # the kernel against the plain fp32 path, whose inputs are not rounded: 1.6e-3
    assert result["logit_error_of_max"] < 5e-4 and result["greedy_agreement"] == 1.0, result
    sampling = RowSampling.stack([SamplerSettings(do_sample=True, temperature=0.8, top_k=20, top_p=1.0)] * rows, "cpu")
    seeds, frame = torch.randint(0, 2**62, (rows,)), torch.arange(rows) + 3
    nonfinite = torch.zeros(1, dtype=torch.int32)
    with torch.no_grad():
        x_in = cp.input_projection(torch.stack((hidden, code0_embed)))
        got = kernel.run(x_in, sampling.temperature, sampling.top_k, sampling.do_sample, seeds, frame,
                         store_logits=True, nonfinite=nonfinite).clone()
    own = torch.stack([choose(kernel.logits[:rows, g], sampling, seeds, frame, g + 1, top_p=False) for g in range(15)], 1)
    assert torch.equal(got, own), (got, own)
    assert nonfinite.item() == 0
    # NaN logits are counted, as the sampler kernel counts them: one NaN weight of one head, one
    # NaN logit per row
    kernel.weights["heads"][3, 0, 0] = float("nan")
    kernel.run(x_in, sampling.temperature, sampling.top_k, sampling.do_sample, seeds, frame, nonfinite=nonfinite)
    assert nonfinite.item() == rows, nonfinite
    print("fp16", result)


# attention tasks: 4 rows each (as at 64 rows; 5 rows make a full and a partial block), and one
# row each (the default at few rows). Every frame costs the interpreter 10-25 s, more with more
# tasks: few rows and runs.
check(tiny, teacher_forced=True, tiles={"attn_rows": 4})
check(as_06b, teacher_forced=False, rows=2)
check_fp16(tiny, tiles={"attn_rows": 4})
print("depth frame ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_depth_frame_equals_the_loop_in_the_interpreter():
    """fp32 (one part): the kernel's draws equal the torch sampler's over the loop's logits (greedy
    rows, temperatures, top-k), its logits equal the loop's, and teacher forcing takes given codes;
    for a code predictor with an input projection (1.7B) and without (0.6B), with one and with four
    rows per attention task. fp16 weights: logits
    within 5e-4 of the largest of the loop's fused path, every in-kernel draw is the torch
    sampler's draw from the kernel's logits, and NaN logits are counted."""
    out = _interpret(FRAME_CHECK)
    print(out)
    assert "depth frame ok" in out


def test_the_engine_runs_the_loop_where_the_kernel_cannot_run_and_says_why(caplog, monkeypatch):
    """--depth kernel off Hopper (here: CPU) falls back to the loop with the reason in the log
    (once per process: forget earlier engines' messages); an unknown setting is refused."""
    import logging
    from pathlib import Path

    from tts_cli.engine import step
    from tts_cli.engine.runner import Engine
    from tts_cli.synthesizer import Synthesizer, code_predictor_settings, talker_settings

    synth = Synthesizer.from_pretrained(Path(__file__).resolve().parents[1] / "tts_cli/assets/tiny-1.7b-customvoice")
    s = synth.ckpt.sampling
    build = lambda depth: Engine(synth.model, synth.codec, rows=2, context=64, talker_defaults=talker_settings(s),
                                 cp_defaults=code_predictor_settings(s), depth=depth)
    monkeypatch.setattr(step, "_logged", set())
    with caplog.at_level(logging.INFO, logger="tts_cli.engine.step"):
        assert build("kernel").step.depth_frame is None
    assert "not the persistent depth kernel (Triton kernels run on CUDA devices, not cpu)" in caplog.text
    with pytest.raises(ValueError, match="depth 'fast': one of auto, kernel, loop"):
        build("fast")


def test_auto_runs_the_kernel_where_it_measured_faster():
    """--depth auto: the kernel over fp16 weights at 2-64 rows (where it measured faster on the
    H200), the loop over bf16 ones and at one row, with the reason. Rows go to the 16-row tile up
    to 16, else to the 64-row one (a 32-row tile measured slower than both); more than 64 are
    refused by name."""
    import torch

    from tts_cli.engine.step import auto_prefers_loop
    from tts_kernels.depth_schedule import row_tile
    assert [row_tile(r) for r in (1, 16, 17, 32, 33, 64)] == [16, 16, 64, 64, 64, 64]
    with pytest.raises(ValueError, match="65 rows: the depth kernel runs up to 64 rows per launch"):
        row_tile(65)
    assert auto_prefers_loop(torch.float16, 2) is None and auto_prefers_loop(torch.float16, 64) is None
    assert "over torch.bfloat16 weights the loop measured faster" in auto_prefers_loop(torch.bfloat16, 64)
    assert "at one row the loop" in auto_prefers_loop(torch.float16, 1)


def test_synth_takes_the_depth_setting_from_the_command_line_and_recipes(monkeypatch, tmp_path):
    """--depth reaches the synthesizer (a recipe's `depth` too), and an unknown value stops the run
    before anything loads, naming the choices."""
    from typer.testing import CliRunner

    from fakes import use_fake_synthesizer
    from tts_cli.cli import app

    synth = use_fake_synthesizer(monkeypatch, tmp_path)
    manifest = tmp_path / "m.txt"
    manifest.write_text("One sentence.\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("depth: kernel\n")
    run = lambda *args: CliRunner().invoke(app, ["synth", str(manifest), "--model", str(tmp_path / "model"),
                                                 "--no-wer", *args])
    result = run("--out", str(tmp_path / "a"), "--recipe", str(recipe))
    assert result.exit_code == 0, result.output
    assert synth.loaded_with["depth"] == "kernel"
    result = run("--out", str(tmp_path / "b"), "--depth", "loop")
    assert result.exit_code == 0 and synth.loaded_with["depth"] == "loop"
    result = run("--out", str(tmp_path / "c"), "--depth", "fast")
    assert result.exit_code == 2 and "--depth fast: one of auto, kernel, loop" in result.output
