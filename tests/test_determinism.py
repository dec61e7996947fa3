"""A seeded row gives the same codes every run, alone or with any batch mates."""
from pathlib import Path

import pytest
import torch

from tts_cli.request import Request
from tts_cli.synthesizer import Synthesizer

TINY = Path(__file__).resolve().parents[1] / "tts_cli" / "assets" / "tiny-1.7b-customvoice"
FRAMES = 24


@pytest.fixture(scope="module")
def synth():
    return Synthesizer.from_pretrained(TINY)


def _codes(synth, requests):
    results = synth.synthesize(requests, max_frames=FRAMES, min_new_tokens=FRAMES + 1)
    return {r.id: r.codes for r in results}


def test_sampled_row_is_the_same_alone_and_in_a_batch(synth):
    row = Request(id="row", text="The birch canoe slid on the smooth planks.", speaker="vivian",
                  language="english", seed=1234)
    mates = [Request(id="long", text="Glue the sheet to the dark blue background, then rest for a while.",
                     speaker="ryan", seed=7),
             Request(id="zh", text="今天天气很好。", speaker="dylan", language="chinese", seed=99)]
    alone = _codes(synth, [row])["row"]
    in_batch = _codes(synth, [mates[0], row, mates[1]])["row"]
    assert alone.shape == (FRAMES, 16)
    assert torch.equal(alone, in_batch)
    assert torch.equal(alone, _codes(synth, [row])["row"])          # and again, run to run


def test_seeds_change_the_draws(synth):
    a = _codes(synth, [Request(id="a", text="A large size in stockings is hard to sell.", speaker="vivian", seed=1)])
    b = _codes(synth, [Request(id="a", text="A large size in stockings is hard to sell.", speaker="vivian", seed=2)])
    assert not torch.equal(a["a"], b["a"])


def test_sampling_differs_from_greedy(synth):
    request = Request(id="a", text="The boy was there when the sun rose.", speaker="vivian", seed=5)
    sampled = _codes(synth, [request])["a"]
    greedy = synth.synthesize([request], greedy=True, max_frames=FRAMES, min_new_tokens=FRAMES + 1)[0].codes
    assert not torch.equal(sampled, greedy)


def test_a_frame_cap_above_the_checkpoints_own_limit_is_noted(synth):
    """--max-frames above the checkpoint's limit (max_new_tokens less one) is used as given, and
    the report's notes say that rows may then run past what the official implementation makes."""
    prompt = synth.prompt(Request(id="a", text="The boy was there when the sun rose.", speaker="vivian"))
    limit = synth.ckpt.sampling.max_new_tokens - 1
    assert synth.frame_cap(prompt, limit) == limit and not any("--max-frames" in n for n in synth.notes)
    assert synth.frame_cap(prompt, limit + 1) == limit + 1
    assert f"--max-frames {limit + 1} is above this checkpoint's own limit of {limit} frames" in synth.notes[-1]
