"""How many slot-steps an admission rule can keep busy: a step model of the engine's admission
(tts_cli/engine/runner.py Engine._run) on `tts bench`'s request lengths, fast enough to try rules the
engine does not have.

The model: a request of n frames makes one frame in each of the n steps after its admission; free
slots are refilled at codec-window boundaries (every K steps), where the host has read the last
step's stop flags; elsewhere it learns of a stop one step late, so a run whose last frame is not
on a boundary ends with one step that makes nothing. tests/test_slot_occupancy.py holds it to the
engine's own step counts; it reproduces the H200 runs' step counts in bench/results.

Per concurrency it prints slots busy (frames / slot-steps) for the engine's rule on the bench's
queue (sentence k % 360 for request k), the share of idle slot-steps spent waiting for a boundary
(requests still queued) and in the ragged end (queue empty), and the same work, with the tail steps,
with the queue longest first (`tts synth`'s order), shortest first, admission at every step (the
codec window still K, the codec starting a row mid-window; the stops known one step late between
boundaries, as the host reads them), so with a wait for each step's flags, so with the codec
decoding each row in windows of its own phase instead (simulate's codec_lag), longest first and
every step; then without the engine's tail steps (simulate's halve_to: once the queue is empty, the
requests still speaking move at a window boundary into a step of half the rows, and again, down to
tts_cli.engine.TAIL_MIN_ROWS, or --tail-min-rows), and the bound max(longest, ceil(frames / c)) steps. With --step-ms (a
step's wall time by rows) it also prices the tail steps. With --prefill, the prompts' positions
the admissions prefill and the token rows and calls of the engine's packed tiles on CUDA
(tts_cli/engine/prefill.py) over them: whole, and after the leading positions every bench prompt
shares (its voice prefixes, from 64 slots on CUDA: tts_cli.engine.voice_prefixes_for).

    python tools/slot_occupancy.py [--concurrency 64,128,256,512] [--requests N] [--window 4]
                                   [--step-ms 64:6.28,128:9.34,256:13.8,512:24.6] [--prefill]
                                   [--tail-min-rows 128]
"""
from __future__ import annotations

import argparse
import math

from tts_cli.bench import auto_frames, default_requests, read_sentences
from tts_cli.engine import TAIL_MIN_ROWS, prefill_tiles_for
from tts_cli.engine.prefill import chunk_rounds, pack


def bench_lengths(count: int, frames: int | None = None) -> list[int]:
    """The frames of `tts bench`'s requests, in queue order."""
    sentences = read_sentences()
    return [frames or auto_frames(sentences[k % len(sentences)]) for k in range(count)]


def prompt_positions() -> tuple[list[int], int]:
    """The talker positions of each bundled sentence's prompt as `tts bench` builds it (CustomVoice,
    vivian, through the bundled model's tokenizer and prompt rules, the real checkpoints'), in the
    sentences' order, and how many leading positions all of them share."""
    from tts_cli.cli import BUNDLED_MODEL_DIR
    from tts_cli.request import Request
    from tts_cli.synthesizer import Synthesizer
    synth = Synthesizer.from_pretrained(BUNDLED_MODEL_DIR)
    prompts = [synth.prompt(Request(id=str(i), text=text, speaker="vivian"))
               for i, text in enumerate(read_sentences())]
    tracks = [list(zip(p.text_ids, p.codec_ids)) for p in prompts]
    shortest = min(map(len, tracks))
    shared = next((k for k in range(shortest) if len({t[k] for t in tracks}) > 1), shortest)
    return [len(p) for p in prompts], shared


def packed_tiles(admissions: list[int], positions: list[int], shared: int, slots: int) -> tuple[int, int, int]:
    """The prompts' positions (request k: positions[k % len], each less its first `shared`), and the
    token rows and calls of the prefill's packed tiles on CUDA over each admission's prompts."""
    tokens = rows = calls = first = 0
    for n in admissions:
        lengths = [positions[k % len(positions)] - shared for k in range(first, first + n)]
        tiles = [size for chunks in chunk_rounds(lengths) for size, _ in pack(chunks, prefill_tiles_for(slots, True))]
        tokens, rows, calls, first = tokens + sum(lengths), rows + sum(tiles), calls + len(tiles), first + n
    return tokens, rows, calls


def simulate(lengths: list[int], slots: int, window: int = 4, admit_every: int | None = None,
             halve_to: int | None = None, flags_awaited: bool = False, codec_lag: bool = False) -> dict:
    """Steps, frames and idle slot-steps of one engine run over `lengths` (queue order).
    admit_every: steps between admissions (default: the window). An admission between window
    boundaries knows the stops of the steps before the last one only (the host reads a step's flags
    after launching the next), unless flags_awaited (a wait for each step's flags: the GPU would idle
    while the host admits). codec_lag: a row admitted at column j of a window keeps the codec's
    windows but is decoded K - j frames late (its first codec window starts at the next boundary),
    so the codec never starts a row mid-window; its slot takes no new row whose first codec window
    is not after its last one. halve_to: the engine's tail steps
    (Engine tail_rows slots / 2, slots / 4 ... down to halve_to; None: none): once the queue is
    empty, at each window boundary the steps go on in the smallest of them that holds the slots still
    speaking; slot-steps then count its rows. graph_steps: steps by the rows of the step; admissions:
    the requests admitted at each admission that admits any; starts: the step each request's first
    frame is made in, in queue order."""
    every = admit_every or window
    queue = list(reversed(lengths))
    left = [0] * slots          # frames each slot still makes
    held = [False] * slots      # the host's view: the slot holds a request that has not stopped
    steps = frames = waiting = ragged = slot_steps = 0
    graph_steps: dict[int, int] = {}
    admissions, starts = [], []
    previous = None             # stop flags of the last step, not read yet
    column = 0
    graph = slots               # the rows of the step that runs
    codec_window = 0            # the codec window the steps now fill
    lag = [0] * slots           # codec_lag: frames a slot's request is decoded late
    last_window = [-1] * slots  # codec_lag: the codec window of the slot's previous request's last frame

    def read_stops(flags):
        for slot, stopped in enumerate(flags):
            if stopped:
                held[slot] = False

    while True:
        if column % every == 0:
            if previous is not None and (column == 0 or flags_awaited):
                read_stops(previous)
                previous = None
            first_window = codec_window + (column > 0)   # a lagged request's first codec window
            free = [s for s in range(slots) if not held[s] and not (codec_lag and last_window[s] >= first_window)]
            free = free[:len(queue)]
            for slot in free:
                left[slot], held[slot] = queue.pop(), True
                lag[slot] = -column % window if codec_lag else 0
                starts.append(steps)
            if free:
                admissions.append(len(free))
        if column == 0:
            while halve_to and not queue and graph // 2 >= halve_to and sum(held) <= graph // 2:
                graph //= 2
        if any(held):
            at, column = column, (column + 1) % window
            steps += 1
            busy = sum(n > 0 for n in left)
            frames += busy
            graph_steps[graph] = graph_steps.get(graph, 0) + 1
            slot_steps += graph
            if queue:
                waiting += slots - busy
            else:
                ragged += graph - busy
            flags = [held[s] and left[s] == 1 for s in range(slots)]
            for s in range(slots):
                if flags[s]:
                    last_window[s] = codec_window + (at + lag[s]) // window
            if column == 0:
                codec_window += 1
            left = [max(n - 1, 0) for n in left]
            if previous is not None:
                read_stops(previous)
            previous = flags
        else:
            codec_window += column > 0
            column = 0
            if previous is not None:
                read_stops(previous)
                previous = None
            if not queue:
                break
    return {"steps": steps, "frames": frames, "busy": frames / slot_steps, "waiting": waiting,
            "ragged": ragged, "graph_steps": graph_steps, "admissions": admissions,
            "starts": starts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="64,128,256,512")
    parser.add_argument("--requests", type=int, default=None, help="default: tts bench's on CUDA")
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--step-ms", help="'ROWS:MS,...': a step's wall time by its rows (every c and its tails'), "
                        "to price the tail steps in audio-s/s (80 ms of audio a frame)")
    parser.add_argument("--prefill", action="store_true",
                        help="the prompts' positions and the prefill's packed tiles over them")
    parser.add_argument("--tail-min-rows", type=int, default=TAIL_MIN_ROWS,
                        help="the fewest rows a tail step runs (a rule for the engine to try; its own: %(default)s)")
    args = parser.parse_args()
    step_ms = {int(r): float(t) for r, t in (item.split(":") for item in args.step_ms.split(","))} \
        if args.step_ms else None
    positions, shared = prompt_positions() if args.prefill else ([], 0)
    print("| c | requests | steps | slots busy | idle: waiting / ragged end | longest first | shortest first "
          "| every step | every step, flags awaited | every step, codec lag | longest first, every step "
          "| no tail steps | bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    priced = []
    for slots in (int(c) for c in args.concurrency.split(",")):
        lengths = bench_lengths(args.requests or default_requests(slots))
        now = simulate(lengths, slots, args.window, halve_to=args.tail_min_rows)
        idle = now["waiting"] + now["ragged"]
        rules = [simulate(sorted(lengths, reverse=True), slots, args.window, halve_to=args.tail_min_rows),
                 simulate(sorted(lengths), slots, args.window, halve_to=args.tail_min_rows),
                 simulate(lengths, slots, args.window, admit_every=1, halve_to=args.tail_min_rows),
                 simulate(lengths, slots, args.window, admit_every=1, halve_to=args.tail_min_rows,
                          flags_awaited=True),
                 simulate(lengths, slots, args.window, admit_every=1, halve_to=args.tail_min_rows, codec_lag=True),
                 simulate(sorted(lengths, reverse=True), slots, args.window, admit_every=1,
                          halve_to=args.tail_min_rows),
                 simulate(lengths, slots, args.window)]
        bound = sum(lengths) / (max(max(lengths), math.ceil(sum(lengths) / slots)) * slots)
        print(f"| {slots} | {len(lengths)} | {now['steps']} | {now['busy']:.1%} | {now['waiting'] / idle:.0%} / "
              f"{now['ragged'] / idle:.0%} | " + " | ".join(f"{r['busy']:.1%}" for r in rules) + f" | {bound:.1%} |")
        if step_ms:
            audio_s = now["frames"] * 0.08
            wall_s = [sum(step_ms[g] * n for g, n in r["graph_steps"].items()) / 1000 for r in (now, rules[-1])]
            priced.append(f"c{slots}: {audio_s / wall_s[0]:.0f} audio-s/s, "
                          f"without tail steps {audio_s / wall_s[1]:.0f}")
        if args.prefill:
            for skip, what in ((0, "whole prompts"), (shared, f"after the {shared} positions all prompts share")):
                tokens, rows, calls = packed_tiles(now["admissions"], positions, skip, slots)
                priced.append(f"c{slots}: {len(now['admissions'])} admissions of {sum(now['admissions'])} prompts, "
                              f"{what}: {tokens} positions in {calls} packed tiles of {rows} token rows "
                              f"({tokens / rows:.0%} used)")
    for line in priced:
        print(line)


if __name__ == "__main__":
    main()
