"""Requests in, audio out, with the plain reference model: tokenizer -> prompt -> generate ->
codec. The CLI's `synth` uses it on CPU; the GPU engine is tested against it.

Each checkpoint kind takes the rows its official generate method takes: CustomVoice a speaker
(and an instruct on 1.7B), Base a reference voice (`Request.reference`: x-vector only, or ICL with
the reference's codes and transcript), VoiceDesign an instruct. An ICL row's codes are decoded
after the reference's codes (the codec primed with the reference) and its waveform starts where
the reference's ends. The GPU engine runs every kind and both text modes, mixed in one call: the
streaming text mode's trailing text per slot, an ICL row's codec state primed with its reference
(tts_cli/engine/runner.py), its waveform cut here as on the plain path."""
from __future__ import annotations

import functools
import gc
import logging
import math
import time
from dataclasses import dataclass, field, fields
from typing import Callable, Iterable
from pathlib import Path

import numpy as np
import torch

from tts_cli.checkpoint import BASE, CUSTOM_VOICE, VOICE_DESIGN, Checkpoint, ModelConfig, SamplingConfig, open_checkpoint
from tts_cli.engine import (AUTO_ROWS, DEFAULT_CODEC_PRECISION, DEFAULT_DEPTH, DEFAULT_ENGINE_ROWS, DEFAULT_TALKER_PRECISION,
                            TALKER_PRECISIONS)
from tts_cli.engine.prefill import COLUMNS
from tts_cli.engine.runner import Engine, EngineRequest, EngineResult, PromptSource
from tts_cli.engine.slots import most_positions, talker_kv_bytes
from tts_cli.errors import CheckpointError, RequestError, SynthesisCancelled, TTSError
from tts_cli.model.codec import load_codec
from tts_cli.model.generate import RowInput, generate
from tts_cli.model.prompt import (Prompt, assistant_text, build_prompt, check_speaker, instruct_text,
                                  prompt_embeddings, reference_text, resolve_language_id, trailing_text_embeddings)
from tts_cli.model.qwen3_tts import Qwen3TTS
from tts_cli.model.sampler import SamplerSettings
from tts_cli.request import Request, Result, VoiceReference
from tts_cli.textsplit import is_empty_text
from tts_cli.voice.checks import clone_problem

log = logging.getLogger(__name__)

# Default frame cap per row: generous headroom over real speech (about 4 frames per text token
# in English and Chinese), so only a runaway row hits it; it is flagged when it does.
CAP_BASE_FRAMES = 50
CAP_FRAMES_PER_TOKEN = 15
# An engine's talker context is the call's rounded up to this many positions (fewer rebuilds).
ENGINE_CONTEXT_STEP = 256
# The engine's tail steps (tts_cli.engine.tail_rows_for) are not built here: the queue goes longest
# first (longest_first), so the last requests are short and few slots idle at a call's end, while the
# tails' graphs add to each engine build (H200, 4096 rows x 100 frames at 512 rows, 2026-12-04: build
# 2.84 s against 1.95 without; docs/bench.md).
SYNTH_TAIL_ROWS = ()
# The talker KV cache may take this share of the GPU memory free when an engine is built; the rest
# is for CUDA graphs, activations and the codec's state.
KV_MEMORY_FRACTION = 0.5
# What an engine's step needs per slot besides the KV cache (activations, the codec's state and
# window, the code predictor's caches, the CUDA graphs' pools), as the allocator reserves it: `--rows
# auto` chooses no more slots than the rest of the free memory holds at this rate. `tools/slot_memory.py
# --rows 512,1024,2048 --frames 100` (random 1.7B fp16 weights, H100 80GB, 2026-12-06): 12.09 and 11.56
# MiB a slot allocated at 512 and 1024 slots, 24.87 and 23.29 reserved; 2048 slots ran out of memory
# (at 76 GiB allocated), which at 16 MiB this rule had let `--rows auto` try.
STEP_BYTES_PER_SLOT = 25 * 2**20


def free_gpu_bytes(device: torch.device) -> int | None:
    """The memory free on `device` now, with what released engines held: an engine's buffers and CUDA
    graphs sit in reference cycles, freed by a collection only (read before one, the memory of an
    engine that had run out of it left `--rows auto` 64 slots for the retry: H100, 2026-12-06).
    None off CUDA."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def _held(needs: list[int], most: int | None) -> int:
    """The most talker positions that the segments of `needs` which fit in `most` positions need (all of
    them where most is None; 0 where none fits)."""
    return max((n for n in needs if most is None or n <= most), default=0)


@dataclass
class SynthesisTiming:
    """Where the engine path's calls spent their time, summed over the calls, for the report."""
    calls: int = 0
    prompt_seconds: float = 0.0         # the requests' prompts as token ids, before the engine runs
    engine_build_seconds: float = 0.0   # engines built and their CUDA graphs captured
    engine_seconds: float = 0.0         # Engine.run, its waits for the GPU included
    gpu_wait_seconds: float = 0.0       # of those, the engine's thread blocked on the GPU
    row_callback_seconds: float = 0.0   # of those, handing finished rows over (each Result built, delivered)
    prompt_vector_seconds: float = 0.0  # of those, building the prompts' vectors (mostly while the GPU works)
    pcm_copy_seconds: float = 0.0       # of those, copying the windows' PCM to the rows' arrays (likewise)
    steps: int = 0
    slot_steps: int = 0                 # steps x the slots they ran (a tail step's fewer)
    frames: int = 0
    stage_ms: dict = field(default_factory=dict)   # GPU ms per stage (CUDA events), prefill included
    peak_gpu_bytes: int = 0             # torch.cuda.max_memory_allocated after the calls (the most of any worker)

    @staticmethod
    def merged(timings: Iterable["SynthesisTiming"]) -> "SynthesisTiming":
        """Several synthesizers' timing summed (--gpus workers): per step, the mean over their steps."""
        total = SynthesisTiming()
        for timing in timings:
            for name in (f.name for f in fields(SynthesisTiming) if f.name not in ("stage_ms", "peak_gpu_bytes")):
                setattr(total, name, getattr(total, name) + getattr(timing, name))
            total.peak_gpu_bytes = max(total.peak_gpu_bytes, timing.peak_gpu_bytes)
            for name, ms in timing.stage_ms.items():
                total.stage_ms[name] = total.stage_ms.get(name, 0.0) + ms
        return total

    def as_dict(self) -> dict:
        steps = max(self.steps, 1)
        return {"calls": self.calls, "prompt_seconds": round(self.prompt_seconds, 3),
                "engine_build_seconds": round(self.engine_build_seconds, 3),
                "engine_seconds": round(self.engine_seconds, 3),
                "gpu_wait_seconds": round(self.gpu_wait_seconds, 3),
                "row_callback_seconds": round(self.row_callback_seconds, 3),
                "prompt_vector_seconds": round(self.prompt_vector_seconds, 3),
                "pcm_copy_seconds": round(self.pcm_copy_seconds, 3), "steps": self.steps,
                "slots_busy": round(self.frames / self.slot_steps, 3) if self.slot_steps else None,
                "ms_per_step": round(self.engine_seconds * 1000 / steps, 3),
                "gpu_ms_per_step": {name: round(ms / steps, 3) for name, ms in self.stage_ms.items()},
                "peak_gpu_gib": round(self.peak_gpu_bytes / 2**30, 2) if self.peak_gpu_bytes else None}


def load_tokenizer(root: Path):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    # AutoTokenizer reads config.json and warns that `qwen3_tts` is no transformers model type:
    # true and harmless, we only want the tokenizer.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(root))
    except Exception as e:  # transformers raises many types for broken tokenizer files
        raise CheckpointError(f"cannot load the tokenizer files in {root}: {e}") from None
    finally:
        hf_logging.set_verbosity(verbosity)


def talker_settings(s: SamplingConfig) -> SamplerSettings:
    return SamplerSettings(s.do_sample, s.temperature, s.top_k, s.top_p, s.repetition_penalty)


def code_predictor_settings(s: SamplingConfig) -> SamplerSettings:
    return SamplerSettings(s.subtalker_do_sample, s.subtalker_temperature, s.subtalker_top_k, s.subtalker_top_p)


def weights_dtype(device: str, talker_precision: str = DEFAULT_TALKER_PRECISION) -> torch.dtype:
    """The talker's and code predictor's weights: on CUDA fp16 or bf16 (tts_cli.engine.TALKER_PRECISIONS;
    activations stay fp32 and the fused kernels hold the fp32 model's numbers within 1e-4,
    docs/numerics.md), fp32 on CPU."""
    if talker_precision not in TALKER_PRECISIONS:
        raise ValueError(f"talker_precision must be one of {TALKER_PRECISIONS}, got {talker_precision!r}")
    if not str(device).startswith("cuda"):
        return torch.float32
    return torch.float16 if talker_precision == "fp16" else torch.bfloat16


def numerics(device: str, codec_precision: str, weights: torch.dtype) -> str:
    """What a run on `device` computes in, for reports; weights: the talker's dtype."""
    if not str(device).startswith("cuda"):
        return "float32"
    inputs = {torch.float16: "rounded to fp16", torch.bfloat16: "as two bf16 halves"}.get(weights, "in fp32")
    vocoder = "fp16 inputs, fp32 accumulation" if codec_precision == "fp16" else "fp32 with TF32"
    return (f"{str(weights).replace('torch.', '')} weights, fp32 activations (projection inputs {inputs}); "
            f"codec fp32, its vocoder's convolutions {vocoder}")


def allow_tf32() -> None:
    """TF32 tensor cores for the codec's fp32 matmuls (cuDNN convolutions use them by default):
    50.7 dB SNR against exact fp32 on the H200 (docs/numerics.md). Set by the commands that
    synthesize on CUDA; tests compare exact fp32 with it off."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def check_request(cfg: ModelConfig, request: Request) -> None:
    """What the row asks for against what its checkpoint's kind can do (RequestError naming it)."""
    if is_empty_text(request.text):   # (the manifest's rule: a library caller's request meets it here)
        raise RequestError("empty text")
    check_no_added_tokens(cfg, request)
    check_voice(cfg, request.speaker, request.instruct, request.reference is not None)
    if cfg.model_type == BASE:
        if request.reference is None:
            raise RequestError("a Base checkpoint clones a voice: the row needs a reference (ref_audio)")
        check_reference(cfg, request.reference)
    resolve_language_id(cfg, request.speaker if cfg.model_type == CUSTOM_VOICE else None, request.language)


def check_no_added_tokens(cfg: ModelConfig, request: Request) -> None:
    """RequestError naming the first of the tokenizer's added tokens (cfg.added_tokens) written in the
    row's text, instruct or reference transcript: it would not be spoken but read as that one token."""
    transcript = request.reference.text if request.reference is not None else request.ref_text
    for name, value in (("text", request.text), ("instruct", request.instruct), ("ref_text", transcript)):
        found = value and next((token for token in cfg.added_tokens if token in value), None)
        if found:
            raise RequestError(f"{name} holds {found!r}, one of the tokenizer's own tokens: it would be read as that "
                               "token, not spoken; take it out of the text")


def check_voice(cfg: ModelConfig, speaker: str | None, instruct: str | None, has_reference: bool) -> None:
    """A speaker, an instruct and a reference voice against what the checkpoint's kind takes
    (RequestError naming it); a CustomVoice checkpoint needs one of its speakers."""
    kind = cfg.kind_name
    if has_reference and cfg.model_type != BASE:
        raise RequestError(f"a reference voice (ref_audio) needs a Base checkpoint: this is a {kind} checkpoint, "
                           "which has no speaker encoder")
    if cfg.model_type == CUSTOM_VOICE:
        check_speaker(cfg, speaker)
    elif speaker:
        what = "clones the reference voice (ref_audio)" if cfg.model_type == BASE else "takes the voice from instruct"
        raise RequestError(f"speaker '{speaker}': a {kind} checkpoint has no named speakers; it {what}")
    if cfg.model_type == BASE and instruct:
        raise RequestError("instruct: a Base checkpoint takes no instruction (the official generate_voice_clone "
                           "has none); VoiceDesign and CustomVoice 1.7B checkpoints do")


def check_reference(cfg: ModelConfig, reference: VoiceReference) -> None:
    name = f"reference {reference.name}: " if reference.name else "reference: "
    width = cfg.talker.hidden_size
    embedding = reference.speaker_embedding
    if not torch.is_floating_point(embedding) or tuple(embedding.shape) != (width,):
        raise RequestError(f"{name}speaker embedding of shape {tuple(embedding.shape)} ({embedding.dtype}); this "
                           f"checkpoint takes a float x-vector of {width}")
    if not bool(torch.isfinite(embedding).all()):   # (float samples far beyond full scale give NaN)
        raise RequestError(f"{name}its speaker embedding is not finite (NaN or infinity): is the file's level sane?")
    if reference.x_vector_only:
        return
    codes = reference.codes
    if (codes.dim() != 2 or codes.shape[0] < 1 or codes.shape[1] != cfg.num_code_groups
            or torch.is_floating_point(codes)):
        raise RequestError(f"{name}codes of shape {tuple(codes.shape)} ({codes.dtype}); ICL takes integer codes of "
                           f"[frames >= 1, {cfg.num_code_groups}]")
    if int(codes.min()) < 0 or int(codes.max()) >= cfg.code_vocab_size:
        raise RequestError(f"{name}codes outside 0..{cfg.code_vocab_size - 1}")
    if not (reference.text or "").strip():
        raise RequestError(f"{name}ICL needs the reference's transcript (ref_text); without one, clone from "
                           "the x-vector only (x_vector_only)")


def icl_cut(reference_frames: int, total_frames: int, samples: int) -> int:
    """Where an ICL row's waveform starts in the decode of its reference + generated codes: the
    official formula, a float product that for some lengths lands one sample before the frame
    boundary (15 of 22 frames: sample 28799, not 28800), keeping one sample of the reference."""
    return int(reference_frames / max(total_frames, 1) * samples)


def icl_codes(reference: VoiceReference | None) -> torch.Tensor | None:
    """The codes an ICL row's decode starts with (its reference's), or None (no reference codes)."""
    return None if reference is None or reference.x_vector_only else reference.codes.long().cpu()


def engine_audio(result: EngineResult, prime: torch.Tensor | None, samples_per_frame: int) -> np.ndarray:
    """An engine result's waveform; for an ICL row (prime: its reference's codes) the official cut
    of decode(reference + codes) (icl_cut), whose start may keep the reference's last sample."""
    if prime is None:
        return result.pcm
    frames, total = prime.shape[0], prime.shape[0] + result.codes.shape[0]
    kept = frames * samples_per_frame - icl_cut(frames, total, total * samples_per_frame)   # 0 or 1
    tail = result.reference_tail[result.reference_tail.shape[0] - kept:]
    return np.concatenate((tail, result.pcm)).astype(np.float32)


def kernel_preload(device: str):
    """On CUDA with the fused kernels: tts_kernels.preload, started. It loads the kernels that earlier
    runs launched on a thread of its own while the checkpoint loads, where a new process's first
    engine build would load them one by one at their first launches. Else None."""
    if torch.device(device).type != "cuda":
        return None
    import tts_kernels
    if not tts_kernels.available("cuda")[0]:
        return None
    from tts_kernels import preload
    preload.start(device)
    return preload


def longest_first(requests: list[EngineRequest]) -> list[EngineRequest]:
    """The engine's queue with the longest prompts (so the longest texts, which speak longest)
    first, ties in their given order: the slots that free up last then hold short requests, and
    fewer slots idle while a call's last requests finish (tools/admission_order.py). A seeded
    request's audio does not depend on its batch mates, so the order changes no result."""
    return sorted(requests, key=lambda r: -r.prompt_length)


class Synthesizer:
    def __init__(self, ckpt: Checkpoint, model: Qwen3TTS, tokenizer, codec, engine: bool | None = None,
                 engine_rows: int | None = DEFAULT_ENGINE_ROWS, depth: str = DEFAULT_DEPTH,
                 codec_precision: str = DEFAULT_CODEC_PRECISION):
        """engine: run batches through the slot engine (CUDA graphs, streamed codec) instead of the
        plain loop; None: on CUDA devices only. engine_rows: the engine's slots, or None to choose them
        per call (`--rows auto`: tts_cli.engine.AUTO_ROWS; the choices are in `notes`). depth: how the
        engine runs the code predictor (tts_cli.engine.DEPTH_CHOICES); codec_precision: its
        vocoder's convolution inputs (CODEC_PRECISIONS). The engine is kept while calls fit it and
        rebuilt (the old one released first) for a longer context: its talker KV cache is sized from
        the call's longest prompt plus frame cap, at most KV_MEMORY_FRACTION of the GPU memory free
        when it is built; a segment that needs more fails with its own error, the rest go on."""
        self.ckpt, self.model, self.tokenizer, self.codec = ckpt, model, tokenizer, codec
        self.cfg = ckpt.config
        device = model.talker.codec_embedding.weight.device
        self.uses_engine = engine if engine is not None else device.type == "cuda"
        self.engine_rows, self.depth, self.codec_precision = engine_rows, depth, codec_precision
        why = "" if engine is not None else ": the slot engine and its kernels run on CUDA"
        log.info("synthesis path: %s", "slot engine" if self.uses_engine else f"plain model ({device.type}{why})")
        self.kv_budget_bytes: int | None = None   # None: KV_MEMORY_FRACTION of the free GPU memory
        self.step_budget_bytes: int | None = None   # None: the rest of it (`--rows auto`'s choice)
        self._engine_now: Engine | None = None
        self._engine_capped = False   # its context is the most the KV budget held at its build
        self._chosen_for: tuple[int, int | None] = (0, None)   # `--rows auto`'s choice: (fill, smallest's most)
        self.notes: list[str] = []   # what `--rows auto` chose, once per distinct choice
        self.timing = SynthesisTiming()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype | None = None,
                        engine: bool | None = None, engine_rows: int | None = DEFAULT_ENGINE_ROWS,
                        depth: str = DEFAULT_DEPTH, codec_precision: str = DEFAULT_CODEC_PRECISION,
                        talker_precision: str = DEFAULT_TALKER_PRECISION) -> "Synthesizer":
        """dtype of the talker and code predictor weights; default: weights_dtype(device, talker_precision)."""
        dtype = dtype or weights_dtype(device, talker_precision)
        ckpt = open_checkpoint(model_dir)   # first: a folder that is no checkpoint starts nothing
        preload = kernel_preload(device)
        tokenizer = load_tokenizer(ckpt.root)
        model = Qwen3TTS.from_checkpoint(ckpt, device=device, dtype=dtype)
        codec = load_codec(ckpt.speech_tokenizer_dir, device=device, dtype=torch.float32)
        if preload is not None:
            preload.finish()   # before any engine is built, so that no first launch races the preload
        return cls(ckpt, model, tokenizer, codec, engine=engine, engine_rows=engine_rows, depth=depth,
                   codec_precision=codec_precision)

    @property
    def numerics(self) -> str:
        """What this synthesizer computes in (for reports): its weights' actual dtype, which is
        bf16 where an fp16 run's checkpoint holds weights beyond fp16's range."""
        weights = self.model.talker.codec_embedding.weight
        return numerics(str(weights.device), self.codec_precision, weights.dtype)

    @property
    def speakers(self) -> list[str]:
        return self.cfg.speakers

    @property
    def languages(self) -> list[str]:
        return self.cfg.languages

    @property
    def supports_instruct(self) -> bool:
        return self.cfg.supports_instruct

    @property
    def sample_rate(self) -> int:
        return self.codec.sample_rate

    def validate(self, request: Request) -> None:
        """RequestError for a row its checkpoint cannot synthesize. Reads only self.cfg (the
        --gpus pool calls it with a config alone)."""
        voice_problem = clone_problem(request, self.cfg.model_type)   # before the reference is encoded
        if voice_problem:
            raise RequestError(voice_problem)
        check_request(self.cfg, request)

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def non_streaming_mode(self, request: Request) -> bool:
        """The row's text mode: its own, else the official default of the checkpoint's kind."""
        if request.non_streaming_mode is None:
            return self.cfg.default_non_streaming_mode
        return request.non_streaming_mode

    def prompt(self, request: Request) -> Prompt:
        instruct_ids = None
        if request.instruct:
            if self.supports_instruct:
                instruct_ids = self.tokenize(instruct_text(request.instruct))
            else:
                self._note_once(f"instructions ignored: this {self.cfg.name} checkpoint does not support them (as the "
                                "official implementation does)")
        elif self.cfg.model_type == VOICE_DESIGN:
            self._note_once("VoiceDesign rows without an instruct: nothing describes their voice, so each row's "
                            "comes from its seed and changes from row to row (give --instruct or a column instruct)")
        reference = request.reference
        icl = reference is not None and not reference.x_vector_only
        return build_prompt(
            self.cfg, self.tokenize(assistant_text(request.text)),
            request.speaker if self.cfg.model_type == CUSTOM_VOICE else None, request.language, instruct_ids,
            non_streaming_mode=self.non_streaming_mode(request),
            speaker_embedding=reference.speaker_embedding.float() if reference is not None else None,
            reference_ids=self.tokenize(reference_text(reference.text)) if icl else None,
            reference_codes=reference.codes.long() if icl else None)

    def _note_once(self, note: str) -> None:
        """A note for the report, and the log (-v), once per synthesizer. INFO, not WARNING: the run prints
        its notes at the end, and a warning of ours would print on stderr without -v as well."""
        if note not in self.notes:
            log.info("%s", note)
            self.notes.append(note)

    def row_input(self, request: Request, max_frames: int | None = None) -> RowInput:
        """The request as the generation loop's input: prompt embeddings, trailing text, frame cap."""
        prompt = self.prompt(request)
        embeds, trailing_text = self.prompt_vectors(prompt)
        return RowInput(embeds, request.seed, self.frame_cap(prompt, max_frames), trailing_text=trailing_text)

    def prompt_vectors(self, prompt: Prompt) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prompt's talker input vectors and its trailing text's (None: none), on the model's device."""
        talker = self.model.talker
        return prompt_embeddings(talker, prompt, self.model.code_predictor), trailing_text_embeddings(talker, prompt)

    def frame_cap(self, prompt: Prompt, max_frames: int | None) -> int:
        official_cap = self.ckpt.sampling.max_new_tokens - 1   # the last drawn token gets no frame
        if max_frames is not None:
            if max_frames > official_cap:
                self._note_once(f"--max-frames {max_frames} is above this checkpoint's own limit of {official_cap} "
                                f"frames (its max_new_tokens, {official_cap + 1}, less one): a row that does not "
                                "end by itself runs past what the official implementation would make")
            return max_frames
        return min(official_cap, CAP_BASE_FRAMES + CAP_FRAMES_PER_TOKEN * prompt.text_tokens)

    @torch.no_grad()
    def synthesize(self, requests: list[Request], greedy: bool = False, max_frames: int | None = None,
                   min_new_tokens: int = 2, max_rows: int | None = None,
                   on_result: Callable[[int, Result], None] | None = None, cancel=None) -> list[Result | None]:
        """All requests of one call: on the plain path as one lockstep batch; through the engine,
        queued into its engine_rows slots (at most max_rows: the out-of-memory fallback). Raises
        RequestError for an invalid request; through the engine with on_result, for segments that need
        more talker positions than its slots hold only once the call's other rows are delivered.
        on_result(index, result) sees each engine row as it ends; cancel (a threading.Event): once set,
        SynthesisCancelled is raised at the engine's next window boundary, or before the plain path's
        next frame. Returns one entry per request: its Result, or None where on_result had it (nothing
        here keeps its audio then: a call of thousands of rows would hold them all to its end), so
        without on_result every entry is a Result."""
        for r in requests:
            self.validate(r)
        sampling = self.ckpt.sampling.greedy() if greedy else self.ckpt.sampling
        if self.uses_engine:
            start = time.perf_counter()
            prompts = [self.prompt(r) for r in requests]   # token ids; their vectors the engine builds
            caps = [self.frame_cap(p, max_frames) for p in prompts]
            self.timing.prompt_seconds += time.perf_counter() - start
            slots, held = self._slots(len(prompts), [len(p) + cap + 1 for p, cap in zip(prompts, caps)],
                                      any(p.trailing_text_ids for p in prompts))
            try:
                return self._synthesize_with_engine(requests, prompts, caps, sampling, min_new_tokens,
                                                    min(slots, max_rows or slots), held, on_result, cancel)
            except torch.cuda.OutOfMemoryError:
                self._engine_now = None   # not kept: the retry's choice counts its memory as free
                raise
        rows = [self.row_input(r, max_frames) for r in requests]
        outs = generate(self.model, rows, talker_settings(sampling), code_predictor_settings(sampling),
                        min_new_tokens=min_new_tokens, cancel=cancel)
        if cancel is not None and cancel.is_set():
            raise SynthesisCancelled()
        audio = self.decode([o.codes for o in outs], [r.reference for r in requests])
        return [Result(id=r.id, codes=o.codes, audio=a, hit_cap=o.hit_cap)
                for r, o, a in zip(requests, outs, audio)]

    def _synthesize_with_engine(self, requests: list[Request], prompts: list[Prompt], caps: list[int],
                                sampling: SamplingConfig, min_new_tokens: int, slots: int, held: int,
                                on_result=None, cancel=None) -> list[Result | None]:
        """held: the talker positions the engine is to hold (_slots); segments needing more than it
        holds are refused (synthesize)."""
        talker, cp = talker_settings(sampling), code_predictor_settings(sampling)
        primes = [icl_codes(r.reference) for r in requests]
        engine_requests = [EngineRequest(key=i, prompt_embeds=None, seed=r.seed, max_frames=cap,
                                         min_new_tokens=min_new_tokens, talker=talker, cp=cp, codec_prime=prime,
                                         source=PromptSource(len(p), bool(p.trailing_text_ids),
                                                             functools.partial(self.prompt_vectors, p)),
                                         voice_prefix=p.voice_prefix())
                           for i, (r, p, cap, prime) in enumerate(zip(requests, prompts, caps, primes))]
        needs = [len(p) + cap + 1 for p, cap in zip(prompts, caps)]
        start = time.perf_counter()
        engine = self._engine(slots, max(held, 1), any(p.trailing_text_ids for p in prompts))
        self.timing.engine_build_seconds += time.perf_counter() - start
        too_long = [i for i, need in enumerate(needs) if need > engine.context]
        if too_long:
            first = too_long[0]
            error = RequestError(f"{requests[first].id}: its prompt and frame cap need {needs[first]} talker "
                                 f"positions; within the GPU memory budget {slots} slots hold {engine.context} each "
                                 f"(fewer --rows, a lower --max-frames or --segment-chars make room)")
            if on_result is None or len(too_long) == len(requests):
                raise error
            engine_requests = [r for i, r in enumerate(engine_requests) if needs[i] <= engine.context]
        spf = self.codec.samples_per_frame

        def result(res: EngineResult) -> Result:
            return Result(id=requests[res.key].id, codes=torch.from_numpy(res.codes),
                          audio=engine_audio(res, primes[res.key], spf), hit_cap=res.hit_cap)

        results: list[Result | None] = [None] * len(requests)

        def ended(res: EngineResult) -> None:
            if on_result is None:
                results[res.key] = result(res)
            else:
                on_result(res.key, result(res))

        engine.reset_stats()
        try:
            engine.run(longest_first(engine_requests), on_result=ended, cancel=cancel)
        except BaseException:
            self._add_timing(engine, stages=False)   # reading the events could raise over the run's error
            raise
        self._add_timing(engine)
        if too_long:
            raise error   # once the others are delivered: the caller retries these alone (job.py)
        return results

    def _add_timing(self, engine: Engine, stages: bool = True) -> None:
        stages = stages and engine.time_stages
        if stages:
            engine.collect_stage_times()
        stats, timing = engine.stats, self.timing
        timing.calls += 1
        device = self.model.talker.codec_embedding.weight.device
        if device.type == "cuda":
            timing.peak_gpu_bytes = max(timing.peak_gpu_bytes, torch.cuda.max_memory_allocated(device))
        timing.engine_seconds += stats.wall_s
        timing.gpu_wait_seconds += stats.gpu_wait_s
        timing.row_callback_seconds += stats.callback_s
        timing.prompt_vector_seconds += stats.prompt_s
        timing.pcm_copy_seconds += stats.pcm_s
        timing.steps += stats.steps
        timing.slot_steps += stats.slot_steps
        timing.frames += stats.frames
        if stages:
            for name, ms in [*stats.stage_ms.items(), ("prefill", stats.prefill_ms)]:
                timing.stage_ms[name] = timing.stage_ms.get(name, 0.0) + ms

    def _slots(self, segments: int, needs: list[int], trailing_text: bool = False) -> tuple[int, int]:
        """The engine's slots for a call of `segments` segments needing `needs` talker positions, and the
        positions its engine is to hold: engine_rows and the most of needs, or with `--rows auto` the
        first of AUTO_ROWS that the call fills (at most one 64-row tile left empty) and whose KV cache
        (and trailing text) the memory budget holds for the segments' positions, those that not even
        AUTO_ROWS[-1] slots hold set aside (they fail on their own). An earlier call's engine is kept
        while it holds this call's segments and the call fills no more slots than the one it was
        chosen for (after rows retried alone on 64 slots, a large call chooses again)."""
        if self.engine_rows is not None:
            return self.engine_rows, max(needs)
        tile = AUTO_ROWS[-1]
        fill = min(AUTO_ROWS[0], tile * math.ceil(segments / tile))   # (past the most slots, no other choice)
        chosen_fill, smallest = self._chosen_for
        engine, need = self._engine_now, _held(needs, smallest)
        if engine is not None and engine.rows <= fill <= chosen_fill and engine.context >= need:
            return engine.rows, need   # keeping an earlier call's engine costs nothing
        self._engine_now = engine = None   # (the local too) its memory counts as free for the choice
        free = free_gpu_bytes(self._device)
        try:
            smallest = self._most_context(tile, trailing_text, free)
        except TTSError:   # not even one prefill tile's positions: every segment fails
            smallest = 0
        need = _held(needs, smallest)
        rows = next((r for r in AUTO_ROWS if r <= fill and self._holds(r, need, trailing_text, free)), tile)
        self._chosen_for = (fill, smallest)
        note = f"--rows auto: {rows} engine slots for calls of {segments} segments (up to {need} talker positions)"
        if note not in self.notes:
            self.notes.append(note)
            log.info("%s", note)
        return rows, need

    def _holds(self, rows: int, need: int, trailing_text: bool, free: int | None) -> bool:
        """Whether the GPU memory holds `rows` slots: their KV cache for `need` positions within the KV
        budget, and their step's working set (STEP_BYTES_PER_SLOT each) within the rest. free: the
        GPU's free bytes (free_gpu_bytes)."""
        step_budget = self.step_budget_bytes
        if step_budget is None and free is not None:
            step_budget = int(free * (1 - KV_MEMORY_FRACTION))
        if step_budget is not None and rows * STEP_BYTES_PER_SLOT > step_budget:
            return False
        try:
            most = self._most_context(rows, trailing_text, free)
        except TTSError:   # not even one prefill tile's positions
            return False
        return most is None or most >= need

    @property
    def _device(self) -> torch.device:
        return self.model.talker.codec_embedding.weight.device

    def _engine(self, rows: int, context: int, trailing_text: bool = False) -> Engine:
        """One engine (and its CUDA graphs), kept while calls fit it; rebuilt, the old one released
        first, for another slot count, a longer context, another codec precision or trailing text
        where it has none (not for a longer context where its own was all the KV budget held). Its
        context: the call's rounded up, at most what the KV budget holds (requests needing more are
        refused, each with its reason)."""
        engine = self._engine_now
        has_trailing = engine is not None and engine.state.trailing_text is not None
        if (engine is not None and engine.rows == rows and engine.codec_precision == self.codec_precision
                and (has_trailing or not trailing_text)
                and (engine.context >= context or (self._engine_capped and has_trailing == trailing_text))):
            return engine   # (capped: another engine of these rows would hold no more positions)
        self._engine_now = engine = None
        context = ENGINE_CONTEXT_STEP * math.ceil(context / ENGINE_CONTEXT_STEP)
        most = self._most_context(rows, trailing_text, free_gpu_bytes(self._device))
        self._engine_capped = most is not None and most < context
        if most is not None:
            context = min(context, most)
        s = self.ckpt.sampling
        self._engine_now = Engine(self.model, self.codec, rows=rows, context=context,
                                  talker_defaults=talker_settings(s), cp_defaults=code_predictor_settings(s),
                                  top_p=s.top_p < 1 or s.subtalker_top_p < 1, depth=self.depth,
                                  codec_precision=self.codec_precision, trailing_text=trailing_text,
                                  time_stages=True, tail_rows=SYNTH_TAIL_ROWS)
        return self._engine_now

    def _most_context(self, rows: int, trailing_text: bool, free: int | None) -> int | None:
        """The talker positions per slot that the KV budget holds for `rows` slots (a multiple of
        the prefill's tile width), with their trailing text vectors where asked, and the kernels'
        offsets address (slots.most_positions), or None without a budget (CPU, unless
        kv_budget_bytes is set). free: the GPU's free bytes (free_gpu_bytes)."""
        weight = self.model.talker.codec_embedding.weight
        budget = self.kv_budget_bytes
        if budget is None and free is not None:
            budget = int(free * KV_MEMORY_FRACTION)
        if budget is None:
            return None
        most = min(budget // talker_kv_bytes(self.cfg, rows, 1, weight.dtype, trailing_text),
                   most_positions(self.cfg, rows, trailing_text)) // COLUMNS * COLUMNS
        if most < COLUMNS:
            raise TTSError(f"the GPU memory budget for keys and values ({budget / 2**30:.2f} GiB) holds fewer than "
                           f"{COLUMNS} talker positions for {rows} slots: use fewer --rows")
        return most

    def decode(self, codes: list[torch.Tensor], references: list[VoiceReference | None] | None = None):
        """Codes of several rows -> float32 numpy waveforms, one padded causal decode: padding
        at the end cannot change earlier samples of a causal decoder. A row with an ICL reference
        is decoded after the reference's codes and cut where they end (icl_cut)."""
        primes = [icl_codes(ref) for ref in references or [None] * len(codes)]
        full = [c if prime is None else torch.cat((prime, c.cpu())) for c, prime in zip(codes, primes)]
        longest = max(c.shape[0] for c in full)
        if longest == 0:
            return [torch.zeros(0).numpy() for _ in codes]
        device = next(self.codec.parameters()).device
        batch = torch.zeros(len(full), longest, self.cfg.num_code_groups, dtype=torch.int64, device=device)
        for i, c in enumerate(full):
            batch[i, :c.shape[0]] = c
        wav = self.codec.decode(batch).float().cpu()
        spf = self.codec.samples_per_frame
        out = []
        for i, (c, prime) in enumerate(zip(full, primes)):
            row = wav[i, :c.shape[0] * spf]
            if prime is not None:
                row = row[icl_cut(prime.shape[0], c.shape[0], row.shape[0]):]
            out.append(row.numpy())
        return out
