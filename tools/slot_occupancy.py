"""How many slot-steps an admission rule can keep busy: a step model of the engine's admission
(tts_cli/engine/runner.py Engine._run) on `tts bench`'s request lengths, fast enough to try rules the
engine does not have.

The model: a request of n frames makes one frame in each of the n steps after its admission; free
slots are refilled at codec-window boundaries (every K steps), where the host has read the last
step's stop flags; elsewhere it learns of a stop one step late, so a run whose last frame is not
on a boundary ends with one step that makes nothing. tests/test_slot_occupancy.py holds it to the
engine's own step counts; it reproduces the H200 runs' step counts in bench/results.

Per concurrency it prints slots busy (frames / (steps x c)) for the engine's rule on the bench's
queue (sentence k % 360 for request k), the share of idle slot-steps spent waiting for a boundary
(requests still queued) and in the ragged end (queue empty), and the same work with the queue
longest first (what `tts synth` does), shortest first, admission at every step (the codec window
still K), both, and the bound max(longest, ceil(frames / c)) steps.

    python tools/slot_occupancy.py [--concurrency 64,128,256,512] [--requests N] [--window 4]
"""
from __future__ import annotations

import argparse
import math

from tts_cli.bench import auto_frames, default_requests, read_sentences


def bench_lengths(count: int, frames: int | None = None) -> list[int]:
    """The frames of `tts bench`'s requests, in queue order."""
    sentences = read_sentences()
    return [frames or auto_frames(sentences[k % len(sentences)]) for k in range(count)]


def simulate(lengths: list[int], slots: int, window: int = 4, admit_every: int | None = None) -> dict:
    """Steps, frames and idle slot-steps of one engine run over `lengths` (queue order).
    admit_every: steps between admissions (default: the window)."""
    every = admit_every or window
    queue = list(reversed(lengths))
    left = [0] * slots          # frames each slot still makes
    held = [False] * slots      # the host's view: the slot holds a request that has not stopped
    steps = frames = waiting = ragged = 0
    previous = None             # stop flags of the last step, not read yet
    column = 0

    def read_stops(flags):
        for slot, stopped in enumerate(flags):
            if stopped:
                held[slot] = False

    while True:
        if column % every == 0:
            if previous is not None:
                read_stops(previous)
                previous = None
            for slot in [s for s in range(slots) if not held[s]][:len(queue)]:
                left[slot], held[slot] = queue.pop(), True
        if any(held):
            column = (column + 1) % window
            steps += 1
            busy = sum(n > 0 for n in left)
            frames += busy
            if queue:
                waiting += slots - busy
            else:
                ragged += slots - busy
            flags = [held[s] and left[s] == 1 for s in range(slots)]
            left = [max(n - 1, 0) for n in left]
            if previous is not None:
                read_stops(previous)
            previous = flags
        else:
            column = 0
            if previous is not None:
                read_stops(previous)
                previous = None
            if not queue:
                break
    return {"steps": steps, "frames": frames, "busy": frames / (steps * slots), "waiting": waiting,
            "ragged": ragged}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="64,128,256,512")
    parser.add_argument("--requests", type=int, default=None, help="default: tts bench's on CUDA")
    parser.add_argument("--window", type=int, default=4)
    args = parser.parse_args()
    print("| c | requests | steps | slots busy | idle: waiting / ragged end | longest first | shortest first "
          "| every step | longest first, every step | bound |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for slots in (int(c) for c in args.concurrency.split(",")):
        lengths = bench_lengths(args.requests or default_requests(slots))
        now = simulate(lengths, slots, args.window)
        idle = now["waiting"] + now["ragged"]
        rules = [simulate(sorted(lengths, reverse=True), slots, args.window),
                 simulate(sorted(lengths), slots, args.window),
                 simulate(lengths, slots, args.window, admit_every=1),
                 simulate(sorted(lengths, reverse=True), slots, args.window, admit_every=1)]
        bound = sum(lengths) / (max(max(lengths), math.ceil(sum(lengths) / slots)) * slots)
        print(f"| {slots} | {len(lengths)} | {now['steps']} | {now['busy']:.1%} | {now['waiting'] / idle:.0%} / "
              f"{now['ragged'] / idle:.0%} | " + " | ".join(f"{r['busy']:.1%}" for r in rules) + f" | {bound:.1%} |")


if __name__ == "__main__":
    main()
