"""`tts bench`: closed-loop throughput and latency of the engine at several concurrencies.

Concurrency c = rows in flight: an engine with c slots, every request queued at t0, a slot
refilled as soon as its request ends. Each request's length is forced (EOS blocked, cap = its
frame count), because random weights never end speech on their own:
  --frames auto: frames = round(characters / 14 chars per s * 12.5 frames per s), at least 8;
  --frames N: every request N frames (N * 80 ms of audio).

Reported per concurrency:
  audio-s/s  total audio seconds / wall seconds of the timed run (aggregate throughput)
  xRT        per request, audio seconds / seconds from admission to its last frame; mean
  RTF        1 / xRT of the same requests; mean (wall per second of audio, per stream)
  first audio p50/p99: seconds from admission (prefill start) to its first frame on the host
  ms per step: depth (code predictor + its sampling), codec (with --codec-window K: one call
  every K steps, amortized over steps), talker (+ its sampling), prefill, host (wall per step not
  covered by those), from CUDA events around each stage (on CUDA only: on CPU all is host)
  bound by: the stage with the largest share of the step time (bounding_stage)
  GPU wait (JSON only, gpu_wait_ms_per_step): ms per step the host spent blocked on the GPU's events;
  near 0, the host and not the GPU sets the pace
  slots busy: frames / slot-steps (each step's rows: c, or a tail step's fewer), the share of
  slot-steps that made a frame (the rest: slots waiting for a window boundary, and the ragged end
  of the last requests); tail steps (JSON tail_steps: rows -> steps) ran that ragged end
  peak GPU memory (torch.cuda.max_memory_allocated)
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from tts_cli.bench_clone import DEFAULT_REF_SECONDS, DEFAULT_WORKLOAD, ORDERS, bench_reference, model_kind
from tts_cli.checkpoint import CUSTOM_VOICE, Checkpoint, SamplingConfig
from tts_cli.engine.random_model import TINY, build_random, parse_spec, random_config
from tts_cli.engine import (CODEC_STREAM_RULE, CODEC_WINDOW_RULE, DEFAULT_CODEC_PRECISION, DEFAULT_DEPTH,
                            DEFAULT_TALKER_PRECISION)
from tts_cli.engine.runner import Engine, EngineRequest
from tts_cli.errors import TTSError, without_resume_advice
from tts_cli.output.writer import remove_orphaned_temporary_files, write_atomically
from tts_cli.request import Request, VoiceReference
from tts_cli.synthesizer import (STEP_BYTES_PER_SLOT, Synthesizer, allow_tf32, code_predictor_settings, icl_codes,
                                 load_tokenizer, numerics, talker_settings, weights_dtype)

SENTENCES = Path(__file__).resolve().parent / "assets" / "harvard-sentences.txt"
CHARS_PER_SECOND = 14.0
FRAMES_PER_SECOND = 12.5
MIN_FRAMES = 8
WARMUP_FRAMES = 4
CPU_NOTE = ("CPU figures, not GPU figures: the engine's torch reference ops on cpu, stage times not "
            "timed; they show that the bench runs, not how fast tts is (docs/bench.md has GPU figures)")


@dataclass
class BenchRow:
    concurrency: int
    requests: int
    frames: int
    audio_s: float
    wall_s: float
    audio_s_per_s: float
    xrt: float
    rtf: float
    first_audio_p50_s: float
    first_audio_p99_s: float
    ms_per_step: dict
    steps: int
    slots_busy: float
    peak_gpu_gib: float | None
    depth: str   # what ran the code predictor: kernel or loop
    codec_window: int   # K: the codec ran every K steps over the last K frames
    codec_stream: bool  # the codec ran on its own stream beside the steps: the stage times overlap
    bound_by: str | None  # the stage with the largest share of a step (bounding_stage); None: stages not timed
    gpu_wait_ms_per_step: float = 0.0   # the host blocked on the GPU's events (0 on CPU)
    tail_steps: dict = dataclasses.field(default_factory=dict)   # rows -> steps run by the engine's tail steps


def load_synthesizer(spec: str, device: str, dtype: torch.dtype, kind: str = CUSTOM_VOICE) -> Synthesizer:
    """A checkpoint directory, or random:1.7b / random:0.6b built on the device (of `kind`: CustomVoice
    or Base)."""
    size = parse_spec(spec)
    if size is None:
        return Synthesizer.from_pretrained(spec, device=device, dtype=dtype)
    model, codec = build_random(size, device, dtype, kind=kind)
    ckpt = Checkpoint(root=Path(spec), config=random_config(size, kind), sampling=SamplingConfig())
    return Synthesizer(ckpt, model, load_tokenizer(TINY), codec)


def read_sentences(path: Path = SENTENCES) -> list[str]:
    """The non-empty lines of a sentence list."""
    try:
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise TTSError(f"cannot read the sentences {path}: {e}") from None
    if not lines:
        raise TTSError(f"{path}: no sentences (one per line)")
    return lines


def auto_frames(text: str) -> int:
    return max(MIN_FRAMES, round(len(text) / CHARS_PER_SECOND * FRAMES_PER_SECOND))


def make_requests(synth: Synthesizer, sentences: list[str], count: int, frames: int | None,
                  speaker: str, reference: VoiceReference | None = None) -> list[EngineRequest]:
    """Requests in the speaker's voice, or cloning `reference` (Base: tts_cli.bench_clone)."""
    requests = []
    for key in range(count):
        text = sentences[key % len(sentences)]
        n = frames or auto_frames(text)
        request = Request(id=str(key), text=text, speaker=None if reference else speaker, reference=reference)
        prompt = synth.prompt(request)
        embeds, trailing_text = synth.prompt_vectors(prompt)
        requests.append(EngineRequest(key=key, prompt_embeds=embeds, seed=key, max_frames=n, min_new_tokens=n + 1,
                                      trailing_text=trailing_text, codec_prime=icl_codes(reference),
                                      voice_prefix=prompt.voice_prefix()))
    return requests


def bounding_stage(ms_per_step: dict, codec_stream: bool) -> str | None:
    """The stage that bounds a step: the one with the largest share of its time (host included: the
    wall the timed stages leave). A codec on its own stream runs beside the others, so it bounds
    only where it takes longer than they do together. None where the stages were not timed (CPU)."""
    if not any(ms for stage, ms in ms_per_step.items() if stage != "host"):
        return None
    in_line = {stage: ms for stage, ms in ms_per_step.items() if not (codec_stream and stage == "codec")}
    if codec_stream and ms_per_step["codec"] > sum(in_line.values()):
        return "codec"
    return max(in_line, key=in_line.get)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def warmup_requests(requests: list[EngineRequest], concurrency: int) -> list[EngineRequest]:
    """Short requests on the prompts of `requests` whose admissions come in groups of every kind the
    measured run has: all slots at once, then one prompt (slot 0's request ends a wave before the
    others), then three. Triton specializes a kernel for an integer argument of 1 and for multiples
    of 16, so a group size first seen in the measured run can compile there (inside its prefill
    time) on a machine whose kernel cache is cold."""
    count = concurrency + 4
    frames = [WARMUP_FRAMES if i == 0 or i >= concurrency else 2 * WARMUP_FRAMES for i in range(count)]
    return [dataclasses.replace(requests[i % len(requests)], key=i, seed=i, max_frames=f, min_new_tokens=f + 1)
            for i, f in enumerate(frames)]


@torch.no_grad()
def warm_engine(synth: Synthesizer, concurrency: int, requests: list[EngineRequest], **engine_options) -> Engine:
    """An engine of `concurrency` slots whose context fits `requests`, warmed up (graphs captured,
    kernels compiled) on `warmup_requests`, and its prefill's graph of every tile size captured (each
    is captured when first needed), its stats reset."""
    sampling = synth.ckpt.sampling
    context = max(r.prompt_length + r.max_frames + 1 for r in requests)
    engine = Engine(synth.model, synth.codec, rows=concurrency, context=64 * math.ceil(context / 64),
                    talker_defaults=talker_settings(sampling), cp_defaults=code_predictor_settings(sampling),
                    trailing_text=any(r.trailing_text is not None for r in requests), **engine_options)
    engine.run(warmup_requests(requests, concurrency))
    engine.prefill.warm_up(requests[0].prompt_embeds, 0)
    if engine.device.type == "cuda":
        engine.collect_stage_times()
        torch.cuda.synchronize()
    engine.reset_stats()
    return engine


def out_of_memory_message(concurrency: int, done: list[dict]) -> str:
    """Why a level stopped: the GPU's memory, what the last level that fitted peaked at, what to do."""
    total = (f" of {torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30:.1f} GiB"
             if torch.cuda.is_available() else "")
    fitted = [r for r in done if r.get("peak_gpu_gib") is not None]
    before = (f"; c{fitted[-1]['concurrency']} peaked at {fitted[-1]['peak_gpu_gib']} GiB" if fitted else "")
    return (f"c{concurrency}: out of GPU memory{total} for {concurrency} slots (their keys and values and "
            f"the step's working set, ~{STEP_BYTES_PER_SLOT >> 20} MiB a slot){before}. The levels before it are in the results; "
            "bench fewer rows on this GPU")


@torch.no_grad()
def bench_one(synth: Synthesizer, concurrency: int, requests: list[EngineRequest],
              codec_window: int | None = None, depth: str = DEFAULT_DEPTH,
              codec_precision: str = DEFAULT_CODEC_PRECISION, codec_stream: bool | None = None) -> BenchRow:
    cuda = synth.model.talker.codec_embedding.weight.device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    engine = warm_engine(synth, concurrency, requests, time_stages=True, codec_window=codec_window, depth=depth,
                         codec_precision=codec_precision, codec_stream=codec_stream)
    start = time.perf_counter()
    results = engine.run(requests)
    wall = time.perf_counter() - start
    if cuda:
        engine.collect_stage_times()
    frames = sum(len(r.codes) for r in results)
    audio = frames / FRAMES_PER_SECOND
    xrts = [len(r.codes) / FRAMES_PER_SECOND / (r.finished_at - r.admitted_at) for r in results]
    first = [r.first_audio_at - r.admitted_at for r in results if r.first_audio_at is not None]
    ms_per_step = {k: round(v, 3) for k, v in engine.stats.per_step().items()}
    codec_stream = engine.codec_stream is not None
    row = BenchRow(
        concurrency=concurrency, requests=len(requests), frames=frames, audio_s=round(audio, 3),
        wall_s=round(wall, 4), audio_s_per_s=round(audio / wall, 2), xrt=round(statistics.mean(xrts), 3),
        rtf=round(statistics.mean(1 / x for x in xrts), 4),
        first_audio_p50_s=round(_percentile(first, 0.5), 4), first_audio_p99_s=round(_percentile(first, 0.99), 4),
        ms_per_step=ms_per_step, steps=engine.stats.steps,
        slots_busy=round(frames / max(1, engine.stats.slot_steps), 3),
        peak_gpu_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        depth="kernel" if engine.step.depth_frame is not None else "loop", codec_window=engine.codec_window,
        codec_stream=codec_stream, bound_by=bounding_stage(ms_per_step, codec_stream),
        gpu_wait_ms_per_step=round(engine.stats.gpu_wait_s * 1000 / max(1, engine.stats.steps), 3),
        tail_steps={rows: n for rows, n in engine.stats.steps_by_rows.items() if rows < concurrency})
    del engine
    return row


def default_requests(concurrency: int, cuda: bool = True) -> int:
    """Requests per concurrency when not given. On CUDA the protocol of the runtimes we compare with
    (shared/reference/000: 40 sentences at c1, 800 above), and at least three waves per slot
    (1536 at c512), so the ragged end of the last requests weighs little, as in a long batch job.
    On CPU two waves: a check that runs in seconds, not a measurement."""
    if not cuda:
        return 2 * concurrency
    return 40 if concurrency == 1 else max(800, 3 * concurrency)


def run_bench(spec: str, concurrencies: list[int], sentences_path: Path, requests: int | None,
              frames: int | None, device: str, speaker: str = "vivian", codec_window: int | None = None,
              depth: str = DEFAULT_DEPTH, codec_precision: str = DEFAULT_CODEC_PRECISION,
              talker_precision: str = DEFAULT_TALKER_PRECISION, codec_stream: bool = True,
              device_choice: str = "--device", on_row: Callable[[dict], None] | None = None,
              workload: str = DEFAULT_WORKLOAD, ref_seconds: float = DEFAULT_REF_SECONDS,
              order: str = "given") -> dict:
    """codec_stream: the engine's choice (its own stream on CUDA up to 64 rows, tts_cli.engine.
    codec_stream_for), else in line; the CPU always runs it in line. device_choice: why this device
    (tts_cli.cli.DeviceChoice.reason), recorded. on_row: called with the result so far after each
    concurrency (the CLI writes it, so that a failure at a later one keeps the earlier ones).
    workload, ref_seconds: tts_cli.bench_clone. order: the queue as the sentences come ("given", the
    runtimes' protocol) or the longest requests first ("longest", as `tts synth` queues a call:
    fewer idle slots at the ragged end, tools/slot_occupancy.py)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    dtype = weights_dtype(device, talker_precision)
    cuda = device.startswith("cuda")
    if cuda:
        allow_tf32()
    sentences = read_sentences(sentences_path)
    t0 = time.perf_counter()
    synth = load_synthesizer(spec, device, dtype, model_kind(workload))
    load_s = time.perf_counter() - t0
    reference, workload_info = bench_reference(synth, workload, parse_spec(spec), ref_seconds, sentences)
    result = {
        "model": f"bundled {TINY.name}" if Path(spec).resolve() == TINY else spec, "device": device,
        "device_choice": device_choice, "cpu_figures": not cuda, **({} if cuda else {"note": CPU_NOTE}),
        "dtype": str(dtype).replace("torch.", ""), "numerics": numerics(device, codec_precision, dtype),
        **workload_info,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "torch": torch.__version__, "load_s": round(load_s, 2),
        # the bundled list by name: its absolute path only says where tts was installed
        "sentences": f"bundled {SENTENCES.name}" if sentences_path.resolve() == SENTENCES else str(sentences_path),
        "sentence_count": len(sentences),
        "frames": frames or f"auto ({CHARS_PER_SECOND:g} chars/s)", "forced_length": True,
        "codec_window": codec_window or f"auto ({CODEC_WINDOW_RULE})",
        "depth_setting": depth,
        "codec_stream_setting": f"own stream {CODEC_STREAM_RULE}" if codec_stream else "in line",
        "codec_precision": codec_precision if cuda else None,   # on CPU the vocoder runs in fp32
        "talker_precision": talker_precision if cuda else None,   # on CPU the weights are fp32 (dtype)
        "order": order,
        "rows": [],
    }
    for c in concurrencies:
        count = requests or default_requests(c, cuda)
        queue = make_requests(synth, sentences, count, frames, speaker, reference)
        if order == "longest":   # the forced lengths are known here; tts synth orders by prompt length instead
            queue = sorted(queue, key=lambda r: -r.max_frames)
        try:
            row = bench_one(synth, c, queue, codec_window,
                            depth, codec_precision, None if codec_stream else False)
        except torch.cuda.OutOfMemoryError:
            raise TTSError(out_of_memory_message(c, result["rows"])) from None
        result["rows"].append(asdict(row))
        if on_row is not None:
            on_row(result)
    return result


def write_json(result: dict, path: Path) -> None:
    """Atomically: rewritten after each concurrency, the file a kill interrupts keeps the levels already done."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TTSError(f"cannot write the results {path}: {e}") from None
    with without_resume_advice("the results"):
        remove_orphaned_temporary_files(path)   # a bench killed mid-write (SIGKILL) left its file
        write_atomically(path, lambda tmp: tmp.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8"))
