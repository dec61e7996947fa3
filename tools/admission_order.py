"""Do the order and the size of `tts synth`'s calls change how long the engine runs? Engine steps and
slot occupancy for the bundled sentences (repeated as needed), each forced to its text-derived length
(as `tts bench` does), queued in their given order and longest first (tts_cli.synthesizer.longest_first,
what `tts synth` does), in calls of --calls requests each (one engine run per call, as `tts synth`
makes them; its ends leave slots idle).

The step count depends only on the lengths and the engine's admission policy (slots refilled in
groups at codec-window boundaries), not on the device or the weights: the bundled tiny model on
CPU gives the numbers a GPU run would.

    python tools/admission_order.py [--rows 64] [--requests 128,256,360] [--calls N,...] [--orders given,longest]
"""
from __future__ import annotations

import argparse

import torch

from tts_cli.bench import make_requests, read_sentences
from tts_cli.cli import BUNDLED_MODEL_DIR
from tts_cli.engine.runner import Engine
from tts_cli.synthesizer import Synthesizer, code_predictor_settings, longest_first, talker_settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--requests", default="128,256,360")
    parser.add_argument("--calls", default="", help="requests per call, comma-separated (default: all in one)")
    parser.add_argument("--orders", default="given,longest")
    args = parser.parse_args()
    synth = Synthesizer.from_pretrained(BUNDLED_MODEL_DIR)
    sentences = read_sentences()
    sampling = synth.ckpt.sampling
    orders = {"given": lambda queue: queue, "longest": longest_first}
    for count in (int(n) for n in args.requests.split(",")):
        requests = make_requests(synth, sentences, count, None, "vivian")
        frames = sum(r.max_frames for r in requests)
        for call in [int(n) for n in args.calls.split(",") if n] or [count]:
            line = [f"{count} requests, {frames} frames, {args.rows} rows, calls of {call}:"]
            for name in args.orders.split(","):
                steps = slot_steps = 0
                for start in range(0, count, call):
                    engine = Engine(synth.model, synth.codec, rows=args.rows, context=256,
                                    talker_defaults=talker_settings(sampling),
                                    cp_defaults=code_predictor_settings(sampling))
                    with torch.no_grad():
                        engine.run(orders[name](requests[start:start + call]))
                    steps += engine.stats.steps
                    slot_steps += engine.stats.slot_steps
                line.append(f"{name} {steps} steps ({frames / slot_steps:.1%} of slot-steps busy)")
            print("  ".join(line), flush=True)

if __name__ == "__main__":
    main()
