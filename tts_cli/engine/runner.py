"""The engine's loop: admit -> prefill -> decode step -> drain, over a fixed number of row slots
that are refilled from a queue as requests end.

The host never waits inside a step: after launching step n it reads step n-1's outputs from
pinned memory (waiting only on that step's event) and ends finished requests before launching
step n+1 (at a window boundary it first waits for step n's flags as well: below). A request may
come with its prompt's vectors not yet built (a PromptSource): while the host would wait for the
GPU it builds the queue's next such prompts, in queue order, and any left at an admission then, so
building a corpus's prompts overlaps the steps of the requests before them. In those waits it also
copies the PCM of windows that are there into their requests' arrays, a few slots at a time (all at
once only when a window's pinned buffer is needed again).

The codec runs every `codec_window` (K) steps over the window of the last K frames, so admission
happens at window boundaries only (step count mod K == 0). A request that stops mid-window frees
its slot for the next boundary; it ends when the PCM of its last window reaches the host. At a
boundary the host first waits for the flags of the window's last step (copied before its codec
runs), which say who emitted their last frame there, and refills those slots too while the GPU
decodes the window: else they would idle a whole window (a quarter of the requests at K = 4, about
one slot-step per request). When no slot emits anymore (the run's end, or every slot stopped while
requests wait), the window is decoded at once instead of stepping idle slots to its end.

Once the queue is empty, the ragged end of a run (a few long requests still speaking while the
other slots idle) runs on tail steps: at a window boundary the requests still speaking move into the
first slots (SlotState.move) of the smallest tail step that holds them, rows / 2, rows / 4 ... (by
default on CUDA from 128 rows, down to 64: tts_cli.engine.tail_rows_for), a DecodeStep over the first
slots' views (SlotState.head) whose graphs share the full step's memory pool. A request's numbers are
the same in either step, so its audio is too (tests: test_engine.py, test_gpu.py).

With `codec_stream` (CUDA; by default up to 64 rows: codec_stream_for) the codec runs on a stream
of its own, beside the next window's steps: the window's codes are first copied to the codec's own
buffer (the next steps overwrite the window), admission resets a slot's codec state on that stream
(after the window it ends, before the one it starts), and the host reads a window's PCM once that
stream's event says it is there. Without it everything runs in order on one stream. Either way the
same kernels see the same inputs: the audio is the same, bit for bit.

Voice cloning (Base checkpoints) adds two things per request. Its trailing text (the streaming text
mode) goes to its slot at admission (slots.py). An ICL request's codec state starts primed with
its reference's frames, decoded in windows of K as the engine decodes its own (once per distinct
reference, kept for later admissions), so its audio continues the reference as the plain path's
decode of reference + generated codes does; the reference's audio is not part of the output, only
its last frame is kept beside it (EngineResult.reference_tail) for the official cut, which may keep
one sample of it (tts_cli.synthesizer.icl_cut).
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from tts_cli.engine import (CODEC_PRECISIONS, CODEC_STREAM_RULE, DEFAULT_CODEC_PRECISION, DEFAULT_DEPTH,
                            INVARIANT_GEMM_ROWS, TAIL_MIN_ROWS, codec_gemm_scale, codec_stream_for, codec_window_for,
                            prefill_head_rows, prefill_tiles_for, tail_rows_for, voice_prefixes_for)
from tts_cli.engine.prefill import Prefill
from tts_cli.engine.slots import SlotState
from tts_cli.engine.step import STAGES, DecodeStep, PaddedGEMMs
from tts_cli.errors import NonFiniteError, RequestError, SynthesisCancelled
from tts_cli.model.codec import CodecState
from tts_cli.model.host import copy_keeping_gil, to_device
from tts_cli.model.sampler import RowSampling, SamplerSettings
from tts_cli.model.transformer import use_kernels

log = logging.getLogger(__name__)
# Engines with CUDA graphs built in this process: before the first there is no older engine's garbage
# to collect, and a full collection took 0.20-0.24 s of `tts synth`'s engine build (cProfile, H200, 2026-12-04).
_GRAPHED_ENGINES_BUILT = itertools.count()

WAIT_SLOTS = 32     # slots' PCM copied between two looks at the awaited event: ~1 MB, well under a step


@dataclass
class PromptSource:
    """A prompt whose vectors the engine builds itself: while its thread would otherwise wait for
    the GPU, in queue order, or at the request's admission at the latest. Building a corpus's
    prompts then overlaps the steps of the requests before them instead of preceding the first.
    The engine fills in the request's prompt_embeds and trailing_text (a later run reuses them)."""
    length: int                     # positions (the rows of prompt_embeds)
    trailing_text: bool             # it has trailing text (the streaming text mode)
    build: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]   # -> (prompt_embeds, trailing_text)


@dataclass
class EngineRequest:
    key: int                        # the caller's index for this request
    prompt_embeds: torch.Tensor | None   # [L, H] on the engine's device; None: built from `source`
    seed: int
    max_frames: int
    min_new_tokens: int = 2
    talker: SamplerSettings | None = None   # None: the engine's defaults
    cp: SamplerSettings | None = None
    trailing_text: torch.Tensor | None = None   # [N, H] fp32 on the device: streaming text mode, frame f adds row f
    codec_prime: torch.Tensor | None = None     # [R, 16] int64: an ICL reference's codes, decoded before its own
    source: PromptSource | None = None          # with prompt_embeds None: how to build it and trailing_text
    voice_prefix: tuple | None = None   # Prompt.voice_prefix(): its leading positions' ids (engine voice prefixes)

    @property
    def prompt_length(self) -> int:
        return self.source.length if self.prompt_embeds is None else self.prompt_embeds.shape[0]

    @property
    def has_trailing_text(self) -> bool:
        return self.source.trailing_text if self.prompt_embeds is None else self.trailing_text is not None


@dataclass
class EngineResult:
    key: int
    codes: np.ndarray               # [frames, 16] int64
    pcm: np.ndarray                 # [frames * 1920] float32
    hit_cap: bool
    admitted_at: float              # perf_counter seconds
    first_audio_at: float | None
    finished_at: float
    error: str | None = None
    reference_tail: np.ndarray | None = None   # ICL: the last frame (1920 samples) of the primed reference's PCM


@dataclass
class _Running:
    """A request in a slot. Its codes and PCM go into arrays sized for its frame cap when it is
    admitted (np.empty: memory pages appear as frames are written), so that ending it is a shrink in
    place, not a join of its frames: joining at the end, when a whole wave of rows ends in one
    window, kept the engine's thread from launching steps for ~1.6 ms per row on the H200's host."""
    request: EngineRequest
    admitted_at: float
    codes: np.ndarray               # [max_frames, 16] int64, filled up to `frames`
    pcm: np.ndarray                 # [max_frames * samples per frame] float32, filled up to `decoded` frames
    frames: int = 0                 # frames whose codes are in `codes`
    decoded: int = 0                # frames whose PCM is in `pcm`
    stopped: bool = False           # it emits no more frames (its slot may be reused)
    stopped_on_eos: bool = False    # its draw after its last frame was EOS (so not its cap, even at the cap)
    all_codes: bool = False         # stopped, and the launch that said so is drained: every frame's codes are in
    ended: bool = False             # its result is out
    first_audio_at: float | None = None
    reference_tail: np.ndarray | None = None


@dataclass
class _Launch:
    """What one launch (a decode step, or the decode of a window closed early) leaves to read."""
    buffers: dict                   # the pinned host buffers its outputs were copied to
    flags_event: object             # CUDA event after the codes, emit flags and counts (None on CPU)
    event: object                   # CUDA event after every copy (None on CPU)
    owners: list                    # slot -> the _Running it held at launch (None: free)
    stepped: bool                   # a decode step: codes and emit flags are in buffers
    window: _Window | None          # the codec ran after it: where the window's PCM lands
    stops_marked: bool = False      # _mark_stops has read its flags (at a window boundary, before _drain)


@dataclass
class _Window:
    """A codec window on its way to the host: its PCM lands in `buffers` once `event` has passed."""
    buffers: dict                   # pinned host buffers: pcm (and the vocoder's overflow count)
    event: object                   # CUDA event after their copies (None on CPU)
    owners: list | None = None      # slot -> the _Running it held (set when its step is drained)
    frames: list | None = None      # slot -> that request's frame count up to this window's end
    read: int = 0                   # its slots below this one have had their PCM copied


@dataclass
class _Run:
    """One call of Engine.run: who holds each slot, the results so far, the windows whose PCM is
    not read yet."""
    running: list                   # slot -> the request whose frames it holds (None: free); a
                                    # stopped one stays until the slot is reused or its last PCM is read
    results: dict                   # key -> result, without on_result only
    on_result: object
    windows: deque = field(default_factory=deque)


@dataclass
class _Level:
    """The decode step at one row count, the engine's or a tail's (module doc), and the pinned host
    buffers its launches copy their outputs to."""
    step: DecodeStep
    host: list                      # two sets of a step's outputs (codes, emit flags, counts), used in turn
    pcm_host: list                  # two sets of a window's PCM (by window parity)

    @property
    def rows(self) -> int:
        return self.step.st.rows


@dataclass
class EngineStats:
    steps: int = 0
    steps_by_rows: dict = field(default_factory=dict)   # decode steps by the rows of the step that ran (tails)
    stage_ms: dict = field(default_factory=lambda: {name: 0.0 for name in STAGES})
    prefill_ms: float = 0.0
    wall_s: float = 0.0
    frames: int = 0                 # frames made (by the requests that ended)
    gpu_wait_s: float = 0.0         # the host blocked on the GPU's events (the rest of wall_s: host work)
    callback_s: float = 0.0         # in on_result, handing finished requests over
    prompt_s: float = 0.0           # building prompts from their PromptSource
    pcm_s: float = 0.0              # copying windows' PCM to the requests' arrays (the ends it allows included)

    @property
    def slot_steps(self) -> int:
        """Slots stepped: each step's rows (a tail's fewer), busy or not."""
        return sum(rows * steps for rows, steps in self.steps_by_rows.items())

    def per_step(self) -> dict:
        n = max(self.steps, 1)
        out = {name: ms / n for name, ms in self.stage_ms.items()}
        out["prefill"] = self.prefill_ms / n
        out["host"] = max(self.wall_s * 1000 / n - sum(out.values()), 0.0)
        return out


def use_fused_kernels(model, codec, device: torch.device, wanted: bool | None) -> bool:
    """Switches the model and codec to their fused paths (tts_cli.model.transformer.use_kernels)
    when the kernels can run here (wanted=None: whenever they can); logs why not. The switch
    stays on the shared modules."""
    import tts_kernels
    ok, why = tts_kernels.available(device.type)
    on = ok and wanted is not False
    if wanted and not ok:
        raise RuntimeError(f"fused kernels asked for but unavailable: {why}")
    if not on:
        log.info("engine: torch reference path, no fused kernels (%s)", why or "switched off")
    elif device.type == "cuda":
        from tts_kernels.conv import tma_available
        tma, why = tma_available(device.index if device.index is not None else torch.cuda.current_device())
        if not tma:
            log.info("engine: the vocoder's convolutions without TMA, as Triton kernels (%s)", why)
    use_kernels(model, on)
    use_kernels(codec, on)
    return on


class Engine:
    def __init__(self, model, codec, rows: int, context: int, talker_defaults: SamplerSettings,
                 cp_defaults: SamplerSettings, use_graphs: bool | None = None, top_p: bool = False,
                 time_stages: bool = False, fused_kernels: bool | None = None, codec_window: int | None = None,
                 depth: str = DEFAULT_DEPTH, codec_precision: str = DEFAULT_CODEC_PRECISION,
                 codec_stream: bool | None = None, trailing_text: bool = False,
                 tail_rows: tuple[int, ...] | None = None, prefill_tiles: tuple[int, ...] | None = None,
                 voice_prefixes: bool | None = None):
        """tail_rows: the row counts of the tail steps, largest first (module doc); None: on CUDA with
        the codec in line, tts_cli.engine.tail_rows_for's. prefill_tiles: the prefill's tile sizes in
        tokens, largest first (prefill.py); None: tts_cli.engine.prefill_tiles_for's.
        voice_prefixes: a request's voice_prefix computed once and its prompt's chunks started after
        it (prefill.py); None: tts_cli.engine.voice_prefixes_for's."""
        if rows < 1:   # else its loop would wait forever for a free slot
            raise ValueError(f"an engine needs at least one row slot, got rows={rows}")
        device = model.talker.codec_embedding.weight.device
        dtype = model.talker.codec_embedding.weight.dtype
        if use_graphs is None:
            use_graphs = device.type == "cuda"
        if use_graphs:
            if next(_GRAPHED_ENGINES_BUILT):
                gc.collect()   # an older engine's graphs and memory go before this one's (graphs.capture)
        else:
            log.info("engine: CUDA graphs off (%s): each step runs eagerly", device.type)
        self.model, self.codec, self.device = model, codec, device
        if codec_precision not in CODEC_PRECISIONS:
            raise ValueError(f"codec_precision must be one of {CODEC_PRECISIONS}, got {codec_precision!r}")
        self.codec_precision = codec_precision
        codec.decoder.half = codec_precision == "fp16"
        kernels = use_fused_kernels(model, codec, device, fused_kernels)
        if kernels:
            model.talker.decoder.cache_rope(context)
            model.code_predictor.decoder.cache_rope(model.cfg.num_code_groups)
        self.rows, self.context = rows, context
        if codec_window is None:
            codec_window = codec_window_for(rows)
        if codec_window < 1:
            raise ValueError(f"codec_window must be >= 1, got {codec_window}")
        self.codec_window = codec_window
        self.talker_defaults, self.cp_defaults = talker_defaults, cp_defaults
        self.state = SlotState(model.cfg, rows, context, codec, device, dtype, talker_defaults, cp_defaults,
                               codec_window, trailing_text=trailing_text)
        self._primed: OrderedDict[bytes, tuple[CodecState, np.ndarray]] = OrderedDict()   # _primed_codec
        if codec_stream is None:
            codec_stream = codec_stream_for(rows, device.type == "cuda")
        elif codec_stream and device.type != "cuda":
            raise ValueError(f"a codec stream needs a CUDA device, not {device.type}")
        # the steps on a high-priority stream: where both have blocks waiting for an SM, theirs go first
        self.step_stream = torch.cuda.Stream(device, priority=-1) if codec_stream else None
        self.codec_stream = torch.cuda.Stream(device) if codec_stream else None
        codec_scale = codec_gemm_scale(rows, rows)
        self.step = DecodeStep(model, codec, self.state, use_graphs, top_p, kernels=kernels, depth=depth,
                               codec_stream=self.codec_stream,
                               padded_gemms={"codec": PaddedGEMMs(scale=codec_scale)} if codec_scale != 1 else None)
        if tail_rows is None:
            tail_rows = () if codec_stream else tail_rows_for(rows, device.type == "cuda")
        if tail_rows and codec_stream:
            raise ValueError("tail steps need the codec in line (codec_stream=False)")
        if list(tail_rows) != sorted(set(tail_rows), reverse=True) or not all(0 < n < rows and rows % n == 0
                                                                               for n in tail_rows):
            raise ValueError(f"tail_rows must decrease, each a divisor of rows ({rows}) below it, got {tail_rows}")
        if device.type == "cuda" and tail_rows and tail_rows[-1] < TAIL_MIN_ROWS:
            raise ValueError(f"tail_rows below {TAIL_MIN_ROWS} on CUDA: there a row's numbers may differ from the "
                             f"full step's (tts_cli.engine.TAIL_MIN_ROWS), got {tail_rows}")
        pin = device.type == "cuda"
        self._levels = [self._new_level(self.step, pin)]
        for n in tail_rows:
            projections = PaddedGEMMs(min_rows=INVARIANT_GEMM_ROWS, scale=rows // n, cublas=kernels)
            padded = {"depth": projections, "talker": projections,
                      "codec": PaddedGEMMs(scale=codec_gemm_scale(rows, n))}
            # the code predictor's loop, as a full step of more than 64 rows runs it (a tail of 64
            # rows would take the persistent kernel under `auto`)
            step = DecodeStep(model, codec, self.state.head(n), use_graphs, top_p, kernels=kernels, depth="loop",
                              pool=self.step.pool, padded_gemms=padded)
            self._levels.append(self._new_level(step, pin))
        self._level = self._levels[0]   # the step launched now
        if prefill_tiles is None:
            prefill_tiles = prefill_tiles_for(rows, device.type == "cuda")
        if device.type == "cuda" and len(prefill_tiles) > 1 and prefill_tiles[-1] < INVARIANT_GEMM_ROWS:
            raise ValueError(f"prefill tiles below {INVARIANT_GEMM_ROWS} tokens on CUDA: there a prompt's numbers may "
                             f"differ from a full tile's (tts_cli.engine.INVARIANT_GEMM_ROWS), got {prefill_tiles}")
        self.prefill = Prefill(model, self.state, prefill_tiles, prefill_head_rows(rows), use_graphs)
        if voice_prefixes is None:
            voice_prefixes = voice_prefixes_for(rows, device.type == "cuda")
        self.voice_prefixes = voice_prefixes
        if voice_prefixes:
            log.info("engine: a named voice's leading prompt positions are computed once (voice prefixes)")
        log.info("engine: %d rows; the codec every %d steps, %s; the ragged end on %s; prefill tiles (tokens): %s",
                 rows, codec_window, "on its own CUDA stream beside the next window's steps" if codec_stream else
                 f"in line after the steps ({CODEC_STREAM_RULE} by default)",
                 f"steps of {' then '.join(map(str, tail_rows))} rows" if tail_rows else
                 f"the full step (tail steps: on CUDA from {2 * TAIL_MIN_ROWS} rows, with the codec in line)",
                 ", ".join(map(str, prefill_tiles)))
        self.time_stages = time_stages and device.type == "cuda"
        self._windows_launched = 0
        self._codec_done = None   # the event after the last window's codec and copies
        self.stats = EngineStats()
        self._pending_times: list = []
        self._unbuilt: deque = deque()   # a run's requests with a PromptSource, in queue order
        self._failed = False      # the last run failed part-way: the next one first clears the slot state

    def _new_level(self, step: DecodeStep, pin: bool) -> _Level:
        st = step.st

        def pinned(outputs):
            return {name: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for name, t in outputs}
        pcm = [("pcm", st.out_pcm)]
        if self._vocoder_overflow() is not None:
            pcm.append(("overflow", self._vocoder_overflow()))
        return _Level(step, [pinned([("codes", st.out_codes), ("emit", st.out_emit), ("nonfinite", st.nonfinite)])
                             for _ in range(2)], [pinned(pcm) for _ in range(2)])

    def _vocoder_overflow(self):
        """The fused fp16 vocoder's count of values beyond fp16's range, or None (no such count)."""
        vocoder = self.codec.decoder
        return vocoder.overflow if vocoder.fused and vocoder.half else None

    # -- admission ------------------------------------------------------------------------------

    def check(self, request: EngineRequest) -> None:
        """A request whose prompt plus frame cap can never fit a slot is refused, not queued."""
        if request.prompt_embeds is None and request.source is None:
            raise ValueError(f"request {request.key} has neither prompt_embeds nor a PromptSource")
        for settings in (request.talker, request.cp):
            if settings is not None and settings.do_sample and settings.top_p < 1 and not self.step.top_p:
                raise RequestError(f"the request samples with top_p {settings.top_p}, but this engine was "
                                   f"built without top-p (Engine(top_p=True) applies it)")
        if request.has_trailing_text and self.state.trailing_text is None:
            raise RequestError("the request has trailing text (the streaming text mode), but this engine was built "
                               "without (Engine(trailing_text=True) holds it)")
        need = request.prompt_length + request.max_frames + 1
        if need > self.context:
            raise RequestError(f"prompt ({request.prompt_length} positions) plus frame cap "
                               f"({request.max_frames}) needs {need} talker positions; this engine's slots "
                               f"hold {self.context}")

    @torch.no_grad()
    def _prefill(self, admitted: list[tuple[int, EngineRequest]]) -> list[np.ndarray | None]:
        """The prefill (prefill.py) of every newly admitted request: keys and values to the slots'
        static caches, the first codebook-0 draw and the trailing text to the slot state, the
        slots' codec state reset, or primed with an ICL reference. Returns each request's
        reference tail (EngineResult), None where it has no reference codes."""
        requests = [r for _, r in admitted]
        primes = [self._primed_codec(r.codec_prime) if r.codec_prime is not None else None for r in requests]
        # Everything the host knows goes over in one copy that does not wait for the step in flight.
        host = torch.tensor([[slot, r.prompt_embeds.shape[0], r.max_frames, r.min_new_tokens, r.seed,
                              self._trailing_length(r)] for slot, r in admitted]
                            + [[slot, 0, 0, 0, 0, 0] for (slot, _), p in zip(admitted, primes) if p is not None],
                            dtype=torch.int64)
        on_device = to_device(host, self.device)
        slots, lengths, caps, min_new_tokens, seeds, trailing_lengths = on_device[:len(admitted)].unbind(1)
        primed_slots = on_device[len(admitted):, 0]
        with self._on_codec_stream():
            # after the window just launched (the slots' previous requests), before the next one
            self.state.codec.reset(slots)
            if primed_slots.shape[0]:
                self._copy_codec_rows(primed_slots, [p[0] for p in primes if p is not None])
        if self.codec_stream is not None:
            on_device.record_stream(self.codec_stream)
        last_hidden, last_logits = self._prefill_tiles(requests, [slot for slot, _ in admitted])
        talker = RowSampling.stack([r.talker or self.talker_defaults for r in requests], self.device)
        cp = RowSampling.stack([r.cp or self.cp_defaults for r in requests], self.device)
        seen = torch.zeros(len(requests), self.model.cfg.codec_vocab_size, dtype=torch.bool, device=self.device)
        g0 = self.step.draw_g0(last_logits, talker, seen, min_new_tokens, seeds, 0)
        trailing = None
        if any(r.trailing_text is not None for r in requests):
            width = self.model.cfg.talker.hidden_size
            trailing = torch.nn.utils.rnn.pad_sequence(
                [r.trailing_text[:self.context] if r.trailing_text is not None
                 else torch.zeros(0, width, device=self.device) for r in requests], batch_first=True)
        self.state.admit(slots, g0=g0, hidden=last_hidden, prompt_lengths=lengths, caps=caps,
                         min_new_tokens=min_new_tokens, seeds=seeds, talker=talker, cp=cp,
                         trailing_text=trailing, trailing_lengths=trailing_lengths)
        return [None if p is None else p[1] for p in primes]

    def prefill_start(self, request: EngineRequest) -> int:
        """Where the request's prompt's prefill starts: after its voice prefix where the engine uses
        voice prefixes and it has one that leaves a position of the prompt after it, else at 0."""
        if not self.voice_prefixes or request.voice_prefix is None:
            return 0
        prefix = len(request.voice_prefix[0])
        return prefix if prefix < request.prompt_length else 0

    def _prefill_tiles(self, requests: list[EngineRequest], slots: list[int]):
        """The prefill's tiles over the requests' prompts (prefill.py) -> (last hidden [n, H], logits
        [n, V]), their voice prefixes' keys and values copied into their slots first: of a prefix kept
        from an earlier admission, or shared by two or more of these (a voice of one row would cost a
        prefill call of its own). Either way a prompt gets the same numbers (prefill.py)."""
        starts = [self.prefill_start(r) for r in requests]
        shared = Counter(r.voice_prefix for r, start in zip(requests, starts) if start)
        starts = [start if start and (shared[r.voice_prefix] > 1 or r.voice_prefix in self.prefill.voices) else 0
                  for r, start in zip(requests, starts)]
        for key in dict.fromkeys(r.voice_prefix for r, start in zip(requests, starts) if start):
            group = [i for i, (r, start) in enumerate(zip(requests, starts)) if start and r.voice_prefix == key]
            self.prefill.voice_prefix(key, requests[group[0]].prompt_embeds[:starts[group[0]]],
                                      [slots[i] for i in group])
        return self.prefill([r.prompt_embeds[start:] for r, start in zip(requests, starts)], slots, starts)

    def _trailing_length(self, request: EngineRequest) -> int:
        """The trailing text vectors its slot takes: no more than a slot has positions (a request
        never has more frames, so the rest would never be read)."""
        return 0 if request.trailing_text is None else min(request.trailing_text.shape[0], self.context)

    # Primed codec states kept for later admissions (a few MB each at the real codec's shapes).
    PRIMED_KEPT = 32

    def _primed_codec(self, codes: torch.Tensor) -> tuple[CodecState, np.ndarray]:
        """A one-row codec state after decoding an ICL reference's codes [R, 16], in windows of K
        frames as the engine decodes its own, and the last frame of PCM that gave (to the host:
        one wait per distinct reference). Kept by the codes' content."""
        key = codes.cpu().numpy().astype(np.int64).tobytes()
        if key in self._primed:
            self._primed.move_to_end(key)
            return self._primed[key]
        with self._on_codec_stream():   # allocated there too: evicted, its memory is that stream's to reuse
            codes = codes.to(self.device, torch.int64)[None]
            state = self.codec.new_state(1)
            for start in range(0, codes.shape[1], self.codec_window):
                pcm = self.codec.decode_step(codes[:, start:start + self.codec_window], state)
            tail = pcm[0, -self.codec.samples_per_frame:].float().cpu().numpy()
        self._primed[key] = (state, tail)
        if len(self._primed) > self.PRIMED_KEPT:
            self._primed.popitem(last=False)
        return state, tail

    def _copy_codec_rows(self, slots: torch.Tensor, sources: list[CodecState]) -> None:
        """The slots' codec state <- the one-row states `sources` (in order). On the codec stream."""
        codec = self.state.codec
        for name, buffer in codec.history.items():
            buffer.index_copy_(0, slots, torch.cat([source.history[name] for source in sources]))
        codec.position.index_copy_(0, slots, torch.cat([source.position for source in sources]))

    # -- the loop ---------------------------------------------------------------------------------

    def run(self, requests: list[EngineRequest], on_result=None, cancel=None) -> list[EngineResult] | None:
        """Synthesizes every request; returns the results in request order, or with on_result None:
        on_result has each as it ends, and the run keeps none (a run of thousands would hold every
        request's PCM to its end). cancel (a threading.Event): once set, SynthesisCancelled is raised
        at the next window boundary, and the engine is ready for another run."""
        for r in requests:
            self.check(r)
        if self._vocoder_overflow() is not None:
            self._vocoder_overflow().zero_()
        self.state.nonfinite.zero_()
        start = time.perf_counter()
        try:
            with self._on_step_stream():
                if self._failed:
                    self._clear_after_failure()
                return self._run(requests, on_result, cancel)
        except SynthesisCancelled:   # (at a window boundary, its slots released: the state is sound)
            raise
        except BaseException:
            self._failed = True
            raise
        finally:
            self._unbuilt.clear()
            self.stats.wall_s += time.perf_counter() - start

    def _clear_after_failure(self) -> None:
        """The slot state as built, once the failed run's work on every stream is done."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.state.clear()
        self._codec_done = None
        self._failed = False

    def _run(self, requests: list[EngineRequest], on_result, cancel) -> list[EngineResult] | None:
        queue = deque(requests)
        self._unbuilt = deque(r for r in requests if r.prompt_embeds is None)
        run = _Run(running=[None] * self.rows, results={}, on_result=on_result)
        self._level = self._levels[0]
        previous = None   # the launch whose outputs are unread
        parity = 0
        column = 0        # steps launched in the current codec window
        while True:
            if column == 0:
                if cancel is not None and cancel.is_set():
                    self._cancel(run)
                if previous is not None:
                    self._mark_stops(previous, run)
                self._admit(queue, run.running)
                if not queue:
                    self._enter_tail(run.running)
            launched = None
            emitting = any(r is not None and not r.stopped for r in run.running)
            if emitting or column > 0:
                buffers = self._level.host[parity]
                parity ^= 1
                window = None
                if emitting:
                    column = (column + 1) % self.codec_window
                    flags_event = self._launch_step(buffers)
                else:
                    self._level.step.close_window(column)
                    column, flags_event = 0, None
                if column == 0:
                    window = self._launch_codec(run)
                launched = _Launch(buffers, flags_event, self._record_event(), run.running[:self._level.rows],
                                   stepped=emitting, window=window)
            if previous is not None:
                self._drain(previous, run)
            if launched is None:   # nothing left to overlap with: the windows' PCM is all there is to wait for
                self._read_windows(run, wait=True)
            previous = launched
            if previous is None and not queue and all(r is None for r in run.running):
                break
        return None if on_result is not None else [run.results[r.key] for r in requests]

    def _cancel(self, run: _Run) -> None:
        """Ends a run at a window boundary: the slots are freed for the next run, nothing is kept."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for slot, owner in enumerate(run.running):
            if owner is not None:
                self.state.release(slot)
        raise SynthesisCancelled()

    def _admit(self, queue: deque, running: list) -> None:
        """Fills free slots (empty, or holding a request that stopped) from the queue. Call at a
        window boundary only: the codec state of an admitted slot restarts there."""
        free = [i for i, r in enumerate(running) if r is None or r.stopped]
        # Every boundary, however few slots are free: a prefill tile costs about the same for 1 or
        # rows / 8 prompts, but waiting for a fuller one idles the free slots a whole window.
        if not queue or not free:
            return
        admitted = [(slot, queue.popleft()) for slot in free[:len(queue)]]
        for _, r in admitted:
            self._build_prompt(r)
        t0 = self._event()
        tails = self._prefill(admitted)
        now = time.perf_counter()
        for (slot, r), tail in zip(admitted, tails):
            running[slot] = _Running(r, now, np.empty((r.max_frames, self.model.cfg.num_code_groups), np.int64),
                                     np.empty(r.max_frames * self.codec.samples_per_frame, np.float32),
                                     reference_tail=tail)
        self._add_time("prefill", t0)

    def _enter_tail(self, running: list) -> None:
        """With the queue empty, at a window boundary: moves the requests still speaking into the first
        slots of the smallest tail step that holds them all (slots.py move), which then runs the steps."""
        speaking = [slot for slot, r in enumerate(running) if r is not None and not r.stopped]
        below = self._levels[self._levels.index(self._level) + 1:]
        fitting = [level for level in below if len(speaking) <= level.rows]
        if not fitting:
            return
        level = fitting[-1]
        movers = [slot for slot in speaking if slot >= level.rows]
        free = [slot for slot in range(level.rows) if running[slot] is None or running[slot].stopped]
        if movers:
            pairs = torch.tensor([movers, free[:len(movers)]], dtype=torch.int64)
            source, target = to_device(pairs, self.device).unbind(0)
            self.state.move(source, target)
            for slot, to in zip(movers, free):
                # a stopped request it replaces still has its last window's PCM to read (_Window.owners)
                running[to], running[slot] = running[slot], None
        self._level = level

    def _launch_step(self, buffers):
        """Launches a decode step and the copies of its outputs; returns the event after the codes,
        emit flags and counts."""
        st = self._level.step.st
        self._run_stage("depth")
        self._run_stage("talker")
        self.stats.steps += 1
        self.stats.steps_by_rows[st.rows] = self.stats.steps_by_rows.get(st.rows, 0) + 1
        buffers["codes"].copy_(st.out_codes, non_blocking=True)
        buffers["emit"].copy_(st.out_emit, non_blocking=True)
        buffers["nonfinite"].copy_(st.nonfinite, non_blocking=True)
        return self._record_event()

    def _launch_codec(self, run: _Run) -> _Window:
        """At a window's end: its codes to the codec's own buffer, then the codec and the copy of
        its PCM, on the codec stream where there is one."""
        st = self._level.step.st
        if self.codec_stream is not None and self._codec_done is not None:
            # the last window's codec may still be reading the codes these overwrite
            torch.cuda.current_stream(self.device).wait_event(self._codec_done)
        st.codec_codes.copy_(st.window_codes)
        buffers = self._level.pcm_host[self._windows_launched % 2]
        self._windows_launched += 1
        self._read_windows(run, freeing=buffers)   # the window two before copied its PCM there
        with self._on_codec_stream():
            self._run_stage("codec")
            buffers["pcm"].copy_(st.out_pcm, non_blocking=True)
            if "overflow" in buffers:
                buffers["overflow"].copy_(self._vocoder_overflow(), non_blocking=True)
            self._codec_done = self._record_event()
            return _Window(buffers, self._codec_done)

    @contextlib.contextmanager
    def _on_step_stream(self):
        """With a codec stream, a run's work is queued on the step stream (after the caller's), and the
        caller's stream waits for both at the end."""
        if self.step_stream is None:
            yield
            return
        caller = torch.cuda.current_stream(self.device)
        self.step_stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self.step_stream):
                yield
        finally:
            caller.wait_stream(self.step_stream)
            caller.wait_stream(self.codec_stream)

    @contextlib.contextmanager
    def _on_codec_stream(self):
        """Work queued inside runs on the codec stream (after what the current stream has queued so
        far), or in order on the current stream where there is none."""
        if self.codec_stream is None:
            yield
            return
        self.codec_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.codec_stream):
            yield

    def _run_stage(self, name: str) -> None:
        t0 = self._event()
        self._level.step.run_stage(name)
        self._add_time(name, t0)

    def _mark_stops(self, launch: _Launch, run: _Run | None = None) -> None:
        """Waits for a decode step's flags (not its codec), then marks the requests that it says will
        not emit at the next step (their EOS or cap) as stopped: their slots are free for the next
        window boundary without waiting for that step."""
        if not launch.stepped or launch.stops_marked:
            return
        launch.stops_marked = True
        if launch.flags_event is not None:
            self._wait(launch.flags_event, run)
        _, emits_next, draws_eos = launch.buffers["emit"].numpy()
        for slot, owner in enumerate(launch.owners):
            if owner is not None and not emits_next[slot]:
                owner.stopped = True
                owner.stopped_on_eos = bool(draws_eos[slot])

    def _drain(self, launch: _Launch, run: _Run) -> None:
        """Reads one finished launch: appends a step's emitted frames and marks the requests that
        will not emit at the next step as stopped; a launch that ended a window queues the window,
        whose PCM is read as soon as it is there (_read_windows). A request ends once it has stopped
        and all its PCM is read. Slots are taken as they were at launch: a slot reused since still
        owes its previous request that window's PCM."""
        if launch.event is not None:
            self._wait(launch.event, run)
        self._mark_stops(launch)
        now = time.perf_counter()
        nonfinite = int(launch.buffers["nonfinite"][0]) if launch.stepped else 0
        if nonfinite:
            raise NonFiniteError(self._non_finite_message(nonfinite))
        emit, codes = launch.buffers["emit"].numpy(), launch.buffers["codes"].numpy()
        for slot, owner in enumerate(launch.owners):
            if owner is None or owner.ended:
                continue
            if launch.stepped and emit[0, slot]:
                owner.codes[owner.frames] = codes[slot]
                owner.frames += 1
            owner.all_codes = owner.stopped   # (stops are marked on the undrained launch only)
            if launch.window is None and owner.all_codes and owner.decoded == owner.frames:
                self._end(slot, owner, run, now)
        if launch.window is not None:
            # Admitted at a boundary and emitting until it stops, a request's frames of this
            # window are its frames not decoded yet, up to this count.
            launch.window.owners = launch.owners
            launch.window.frames = [None if owner is None else owner.frames for owner in launch.owners]
            run.windows.append(launch.window)

    def _read_windows(self, run: _Run, wait: bool = False, freeing: dict | None = None,
                      slots: int | None = None) -> bool:
        """Hands each request the PCM of its frames in the windows whose PCM is there, oldest first,
        and ends the requests whose PCM is then all read. With `wait` it waits for every window;
        with `freeing` (pinned buffers) for the windows up to the one that holds its PCM there; with
        `slots`, it copies at most that many slots' PCM (the engine's waits for the GPU read windows
        a few slots at a time). Returns whether it copied anything."""
        copied = 0
        while run.windows and (slots is None or copied < slots):
            window = run.windows[0]
            if window.event is not None:
                must = wait or any(w.buffers is freeing for w in run.windows)
                if not (must or window.event.query()):
                    break
                if must:
                    self._wait(window.event)
                    window.event = None
            if window.read == 0 and "overflow" in window.buffers:
                self.codec.decoder.check_range(int(window.buffers["overflow"][0]))
            start = now = time.perf_counter()
            callbacks = self.stats.callback_s
            pcm = window.buffers["pcm"].numpy()
            samples = self.codec.samples_per_frame
            end = len(window.owners) if slots is None else min(len(window.owners), window.read + slots - copied)
            for slot in range(window.read, end):
                owner = window.owners[slot]
                if owner is None or owner.ended:
                    continue
                fresh = window.frames[slot] - owner.decoded
                if fresh:
                    copy_keeping_gil(owner.pcm, owner.decoded * samples, pcm[slot, :fresh * samples])
                    owner.decoded += fresh
                    if owner.first_audio_at is None:
                        owner.first_audio_at = now
                if owner.all_codes and owner.decoded == owner.frames:
                    self._end(slot, owner, run, now)
            copied += end - window.read
            window.read = end
            self.stats.pcm_s += time.perf_counter() - start - (self.stats.callback_s - callbacks)   # not on_result's
            if window.read < len(window.owners):
                break
            run.windows.popleft()
        return copied > 0

    def _non_finite_message(self, count: int) -> str:
        message = f"the talker and code predictor produced {count} NaN or infinite logits: this audio would be wrong"
        if self.model.talker.codec_embedding.weight.dtype == torch.float16:
            return (message + "; with fp16 weights an activation most likely went beyond fp16's range (65504): "
                    "--talker-precision bf16 runs them in bf16 with 16-bit inputs instead")
        return message

    def _end(self, slot: int, owner: _Running, run: _Run, now: float) -> None:
        frames = owner.frames
        self.stats.frames += frames
        # No views of the arrays are left, so they shrink in place (realloc): nothing is copied.
        owner.codes.resize((frames, owner.codes.shape[1]), refcheck=False)
        owner.pcm.resize(frames * self.codec.samples_per_frame, refcheck=False)
        result = EngineResult(
            key=owner.request.key, codes=owner.codes, pcm=owner.pcm,
            hit_cap=frames >= owner.request.max_frames and not owner.stopped_on_eos, admitted_at=owner.admitted_at,
            first_audio_at=owner.first_audio_at, finished_at=now, reference_tail=owner.reference_tail)
        owner.ended = True
        if run.on_result is None:
            run.results[owner.request.key] = result
        if run.running[slot] is owner:   # not reused by a request admitted at a window boundary since
            run.running[slot] = None
            self.state.release(slot)
        if run.on_result is not None:
            start = time.perf_counter()
            run.on_result(result)
            self.stats.callback_s += time.perf_counter() - start

    # -- timing -------------------------------------------------------------------------------------

    def reset_stats(self) -> None:
        self.stats = EngineStats()
        self._pending_times.clear()

    def _build_prompt(self, request: EngineRequest) -> None:
        if request.prompt_embeds is not None:
            return
        start = time.perf_counter()
        request.prompt_embeds, request.trailing_text = request.source.build()
        self.stats.prompt_s += time.perf_counter() - start
        if request.prompt_length != request.source.length or request.has_trailing_text != request.source.trailing_text:
            raise ValueError(f"request {request.key}: its prompt was built with {request.prompt_length} positions "
                             f"and trailing text {request.has_trailing_text}; its source said {request.source.length} "
                             f"and {request.source.trailing_text}")

    def _wait(self, event, run: _Run | None = None) -> None:
        """Waits for a GPU event; until it has happened, copies the PCM of `run`'s windows that are
        there (WAIT_SLOTS slots at a time) and builds the queue's next unbuilt prompts (why:
        docs/design.md, "The host's idle time used")."""
        while not event.query():
            if run is not None and self._read_windows(run, slots=WAIT_SLOTS):
                continue
            if not self._unbuilt:
                break
            self._build_prompt(self._unbuilt.popleft())
        start = time.perf_counter()
        event.synchronize()
        self.stats.gpu_wait_s += time.perf_counter() - start

    def _event(self):
        if not self.time_stages:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _record_event(self):
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _add_time(self, name: str, start_event) -> None:
        if start_event is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending_times.append((name, start_event, end))

    def collect_stage_times(self) -> None:
        """Folds the recorded stage events into stats (synchronizes; call after run)."""
        torch.cuda.synchronize()
        for name, start, end in self._pending_times:
            if name == "prefill":
                self.stats.prefill_ms += start.elapsed_time(end)
            else:
                self.stats.stage_ms[name] += start.elapsed_time(end)
        self._pending_times.clear()
