"""Does the order of a call's requests change how long the engine runs? Steps and slot occupancy
for the bundled sentences, each forced to its text-derived length (as `tts bench` does), queued in
their given order and longest first (tts_cli.synthesizer.longest_first, what `tts synth` does).

The step count depends only on the lengths and the engine's admission policy (slots refilled in
groups at codec-window boundaries), not on the device or the weights: the bundled tiny model on
CPU gives the numbers a GPU run would.

    python tools/admission_order.py [--rows 64] [--requests 128,256,360]
"""
from __future__ import annotations

import argparse

import torch

from tts_cli.bench import SENTENCES, make_requests
from tts_cli.cli import BUNDLED_MODEL_DIR
from tts_cli.engine.runner import Engine
from tts_cli.synthesizer import Synthesizer, code_predictor_settings, longest_first, talker_settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--requests", default="128,256,360")
    args = parser.parse_args()
    synth = Synthesizer.from_pretrained(BUNDLED_MODEL_DIR)
    sentences = [line.strip() for line in SENTENCES.read_text(encoding="utf-8").splitlines() if line.strip()]
    sampling = synth.ckpt.sampling
    for count in (int(n) for n in args.requests.split(",")):
        requests = make_requests(synth, sentences, count, None, "vivian")
        frames = sum(r.max_frames for r in requests)
        line = [f"{count} requests, {frames} frames, {args.rows} rows:"]
        for name, queue in (("given order", requests), ("longest first", longest_first(requests))):
            engine = Engine(synth.model, synth.codec, rows=args.rows, context=256,
                            talker_defaults=talker_settings(sampling), cp_defaults=code_predictor_settings(sampling))
            with torch.no_grad():
                engine.run(queue)
            steps = engine.stats.steps
            line.append(f"{name} {steps} steps ({frames / (steps * args.rows):.1%} of slot-steps busy)")
        print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
