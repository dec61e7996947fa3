"""One decode step for every slot, in three stages with fixed shapes (each a CUDA graph on GPU):

  depth:  codebooks 1..15 of the slot's current frame (code predictor + its sampler), written
          into the codec window at column step mod K
  codec:  every K-th step only: the window's K frames -> K * 1920 PCM samples per slot (streamed
          decoder, per-slot state, so decoding K frames at once is the same as one at a time),
          from a copy of the window's codes (the runner's, at the window's end), so that it may
          run on a stream of its own beside the next window's steps (runner)
  talker: the next talker position (frame embedding sum + the slot's text vector: its trailing
          text in the streaming text mode while it lasts, else tts_pad) and the next codebook-0 draw

No host synchronisation inside a step: what the host needs (codes, PCM, which slots emitted)
lands in output buffers that the runner copies to pinned memory and reads one step later.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tts_cli.engine import DEFAULT_DEPTH, DEPTH_CHOICES
from tts_cli.engine.graphs import capture
from tts_cli.engine.slots import SlotState
from tts_cli.model.qwen3_tts import Qwen3TTS
from tts_cli.model.sampler import TalkerLogitsProcessor, choose, gumbel_noise

log = logging.getLogger(__name__)
# In launch order: the talker needs only the depth stage's frame and the codec (at a window's end)
# only the window's codes, so the codec goes last, and the host, waiting at a window boundary for
# the talker's flags of who stopped, refills their slots while the GPU decodes (runner).
STAGES = ("depth", "talker", "codec")
_logged: set[str] = set()   # the depth-setting messages said so far (once per process)


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)


def auto_prefers_loop(weights: torch.dtype, rows: int) -> str | None:
    """Why `--depth auto` runs the loop where the kernel could run, or None (tts_cli.engine:
    where each measured faster)."""
    if weights != torch.float16:
        return f"auto: over {weights} weights the loop measured faster (docs/bench.md)"
    if rows == 1:
        return "auto: at one row the loop, its kernels launched as programmatic dependents, measured faster " \
               "(docs/bench.md)"
    return None


class PaddedGEMMs(TorchFunctionMode):
    """Inside it, cuBLAS GEMMs run on inputs padded with rows, the padding's outputs dropped:
    torch.mm of fewer than `min_rows` rows (the talker's and code predictor's projections,
    tts_kernels.linear: with `cublas` they take cuBLAS at every row count, cublas_projections) on
    `min_rows`, or on `scale` times their rows where that is fewer (the full step's shape, below
    INVARIANT_GEMM_ROWS), and F.linear and torch.addmm (the codec's) on `scale` times their rows:
    padded where scale > 1, in blocks of scale times their rows where it is below 1, the last one
    padded where they do not divide them (tts_cli.engine.codec_gemm_scale). cuBLAS picks its kernel,
    and so a row's summation order, by shape; a tail step (runner) runs in it so that its rows get
    the sums the full step gives them, and a full step of more than CODEC_GEMM_ROWS rows so that its
    codec's GEMMs keep shapes that sum a row alike in every position (tts_cli.engine)."""

    def __init__(self, min_rows: int = 0, scale: int | Fraction = 1, cublas: bool = False):
        super().__init__()
        self.min_rows, self.scale, self.cublas = min_rows, Fraction(scale), cublas
        self._entered: list[contextlib.ExitStack] = []   # one per (nested) entry

    def __enter__(self):
        stack = contextlib.ExitStack()
        if self.cublas:
            from tts_kernels.linear import cublas_projections
            stack.enter_context(cublas_projections())
        self._entered.append(stack)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._entered.pop().close()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.mm and args[0].shape[0] < self.min_rows:
            return self._padded(func, args, 0, min(self.min_rows, int(args[0].shape[0] * self.scale)), kwargs)
        if func is F.linear and self.scale != 1:
            return self._scaled(func, args, 0, kwargs)
        if func is torch.addmm and self.scale != 1:
            return self._scaled(func, args, 1, kwargs)
        return func(*args, **kwargs)

    def _scaled(self, func, args, which: int, kwargs):
        x = args[which]
        rows = x.shape[0] * self.scale   # of each GEMM
        if rows.denominator != 1:
            raise ValueError(f"{x.shape[0]} GEMM rows cannot run in blocks of {rows}")
        rows = int(rows)
        if rows > x.shape[0]:
            return self._padded(func, args, which, rows, kwargs)
        blocks = -(-x.shape[0] // rows)   # the last padded where they do not divide the rows
        whole = x if blocks * rows == x.shape[0] else self._padding(x, blocks * rows)
        out = torch.cat([func(*args[:which], block, *args[which + 1:], **kwargs) for block in whole.split(rows)])
        return out[:x.shape[0]]

    @classmethod
    def _padded(cls, func, args, which: int, rows: int, kwargs):
        x = args[which]
        return func(*args[:which], cls._padding(x, rows), *args[which + 1:], **kwargs)[:x.shape[0]]

    @staticmethod
    def _padding(x: torch.Tensor, rows: int) -> torch.Tensor:
        # the padding rows are left unwritten (no fill kernel): an output row depends only on its own
        # input row, and the padding's outputs are dropped
        padded = x.new_empty(rows, *x.shape[1:])
        padded[:x.shape[0]] = x
        return padded


def emits_next(st: SlotState, eos: int) -> torch.Tensor:
    """Which slots emit a frame at the step about to run (the others stay frozen)."""
    return st.active & (st.g0 != eos) & (st.frame < st.cap)


def start_frame_slots(st: SlotState, talker, emit: torch.Tensor, code0_embed: torch.Tensor, eos: int) -> None:
    """The start of the depth stage: which slots emit at this step (emit [B]), and the embedding
    of each slot's codebook-0 code (code0_embed [B, H]). The reference of tts_kernels.advance's
    start_frame."""
    emit.copy_(emits_next(st, eos))
    code0_embed.copy_(talker.codec_track(st.g0))


def text_vectors_slots(st: SlotState, pad_embed: torch.Tensor, slot_index: torch.Tensor, out: torch.Tensor) -> None:
    """Each slot's text vector for the frame it emits now (out [B, H]): row `frame` of its trailing
    text while there is one (slots.py), else tts_pad's (pad_embed [1, H]). slot_index: arange(B)."""
    vectors = st.trailing_text[slot_index, st.frame.clamp(max=st.trailing_text.shape[1] - 1)]
    out.copy_(torch.where((st.frame < st.trailing_length)[:, None], vectors, pad_embed))


def emit_frame_slots(st: SlotState, emit: torch.Tensor, residual: torch.Tensor, codes: torch.Tensor, cp,
                     code0_embed: torch.Tensor, text_embed: torch.Tensor, talker_input: torch.Tensor) -> None:
    """The end of the depth stage: the frame's codes (codes [B, G]: codebook 0 from g0 where the
    slot emits, else 0; residual [B, G - 1] from the code predictor) into the codec window at its
    column, and the talker's next input (talker_input [B, H]: the frame's codebook embeddings
    summed, plus the text vector: text_embed [1, H], tts_pad's for every slot, or [B, H], each
    slot's). The reference of tts_kernels.advance's emit_frame."""
    # A slot that stopped holds EOS as g0, which is no codec code: it decodes code 0 instead.
    codes[:, 0] = torch.where(emit, st.g0, 0)
    codes[:, 1:] = residual
    st.window_codes.index_copy_(1, st.window_column, codes[:, None])
    talker_input.copy_(cp.frame_embedding(code0_embed, codes[:, 1:]) + text_embed)


def advance_slots(st: SlotState, emit: torch.Tensor, g0: torch.Tensor, hidden: torch.Tensor, codes: torch.Tensor,
                  eos: int) -> None:
    """The end of the talker stage: the step's outputs (the frame's codes [B, G], who emitted),
    and the slots that emitted (emit [B]) move on to their next frame with the draw g0 [B] and
    the talker state hidden [B, H]. The reference of tts_kernels.advance's advance."""
    st.out_codes.copy_(codes)
    st.out_emit[0].copy_(emit)
    # Slots that did not emit stay frozen: their state is what the host reads when it ends them.
    st.seen.scatter_(1, g0[:, None], emit[:, None] | st.seen.gather(1, g0[:, None]))
    st.g0.copy_(torch.where(emit, g0, st.g0))
    st.hidden.copy_(torch.where(emit[:, None], hidden, st.hidden))
    st.position.add_(emit.long())
    st.frame.add_(emit.long())
    # Said now rather than by the next step's emit flags: the host learns a step earlier
    # that a slot is free (runner._drain).
    st.out_emit[1].copy_(emits_next(st, eos))
    st.out_emit[2].copy_(st.g0 == eos)


class DecodeStep:
    def __init__(self, model: Qwen3TTS, codec, state: SlotState, use_graphs: bool, top_p: bool,
                 kernels: bool = False, depth: str = DEFAULT_DEPTH, codec_stream: torch.cuda.Stream | None = None,
                 pool=None, padded_gemms: dict[str, PaddedGEMMs] | None = None):
        """pool: a CUDA graph memory pool to capture into (a tail step shares its engine's: the steps
        never run at once); padded_gemms: stage name -> the padding its GEMMs run with (a tail step's)."""
        self.model, self.codec, self.st = model, codec, state
        self.codec_stream = codec_stream
        self.pool, self.padded_gemms = pool, padded_gemms or {}
        cfg = model.cfg
        device = state.g0.device
        self.eos = cfg.codec_eos_id
        self.top_p = top_p
        # The sampler kernel has no top-p: with top-p the torch sampler draws (same function).
        self.kernels = kernels
        self.sampler_kernel = kernels and not top_p
        if kernels and top_p:
            log.info("engine: torch sampler (top-p is on; the sampler kernel has no top-p)")
        self.process = TalkerLogitsProcessor(cfg.codec_vocab_size, cfg.codec_eos_id, device)
        self.pad_embed = model.talker.text_track(torch.tensor([cfg.tts_pad_id], device=device))
        # intermediates passed between stages (fixed addresses for the graphs)
        self.emit = torch.zeros_like(state.active)
        self.code0_embed = torch.zeros_like(state.hidden)
        self.codes = torch.zeros_like(state.out_codes)
        self.talker_input = torch.zeros_like(state.hidden)
        # the slots' text vectors of the frame they emit: tts_pad's for all, or each slot's own
        # where the engine holds trailing text
        self.text_embed = self.pad_embed
        if state.trailing_text is not None:
            self.text_embed = torch.zeros_like(state.hidden)
            self.slot_index = torch.arange(state.rows, device=device)
        self.depth_frame = self._depth_frame(depth, state.g0.shape[0])
        self.stage_fns = {"depth": self._depth, "codec": self._codec, "talker": self._talker}
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        if use_graphs:
            self._capture()

    def _run_fn(self, name: str) -> None:
        """Stage `name`'s work, launched now (eagerly, or into a capture)."""
        with self.padded_gemms.get(name) or contextlib.nullcontext():
            self.stage_fns[name]()

    def _depth_frame(self, depth: str, rows: int):
        """The persistent depth kernel for `depth` (tts_cli.engine.DEPTH_CHOICES), or None for the
        loop, logging why (each reason once per process)."""
        if depth not in DEPTH_CHOICES:
            raise ValueError(f"depth {depth!r}: one of {', '.join(DEPTH_CHOICES)}")
        if depth == "loop":
            return None
        from tts_cli.engine.depth_check import kernel_unsupported
        cp = self.model.code_predictor
        why = kernel_unsupported(cp, rows)
        if why is None and not self.sampler_kernel:
            why = "the step draws with the torch sampler (top-p, or the fused kernels are off)"
        if why is None and depth == "auto":
            why = auto_prefers_loop(cp.decoder.layers[0].mlp.down_proj.weight.dtype, rows)
        if why is not None:
            _log_once(f"engine: code-predictor loop, not the persistent depth kernel ({why})")
            return None
        from tts_kernels.depth_frame import DepthFrame
        log.info("engine: the code predictor runs as the persistent depth kernel (%d rows)", rows)
        return DepthFrame(cp, rows)

    @torch.no_grad()
    def _depth(self) -> None:
        st, cp = self.st, self.model.code_predictor
        if self.kernels:
            from tts_kernels.advance import start_frame
            start_frame(st, self.model.talker.codec_embedding.weight, self.emit, self.code0_embed, self.eos)
        else:
            start_frame_slots(st, self.model.talker, self.emit, self.code0_embed, self.eos)
        if self.depth_frame is not None:
            sampling = st.cp_sampling
            residual = self.depth_frame.run(cp.input_projection(torch.stack((st.hidden, self.code0_embed))),
                                            sampling.temperature, sampling.top_k, sampling.do_sample, st.seeds,
                                            st.frame, nonfinite=st.nonfinite)
            self._emit_frame(residual)
            return
        noise = None
        if not self.sampler_kernel:   # the 15 codebooks' noise in one batch: a few kernels, not 15 x as many
            groups = range(1, self.model.cfg.num_code_groups)
            noise = gumbel_noise(st.seeds, st.frame, groups, self.model.cfg.code_vocab_size)
        residual, _ = cp.predict_frame(
            st.hidden, self.code0_embed,
            choose=lambda group, logits: self.draw(logits, st.cp_sampling, st.seeds, st.frame, group,
                                                   None if noise is None else noise[group - 1]),
            caches=st.cp_kv)
        self._emit_frame(residual)

    def _emit_frame(self, residual: torch.Tensor) -> None:
        st, cp = self.st, self.model.code_predictor
        if st.trailing_text is not None:
            text_vectors_slots(st, self.pad_embed, self.slot_index, self.text_embed)
        if self.kernels:
            from tts_kernels.advance import emit_frame
            emit_frame(st, self.emit, residual, self.codes, cp.fused_tables[1], self.code0_embed, self.text_embed,
                       self.talker_input)
        else:
            emit_frame_slots(st, self.emit, residual, self.codes, cp, self.code0_embed, self.text_embed,
                             self.talker_input)
        st.window_column.add_(1).remainder_(st.window_codes.shape[1])

    @torch.no_grad()
    def _codec(self) -> None:
        st = self.st
        st.out_pcm.copy_(self.codec.decode_step(st.codec_codes, st.codec).float())

    @torch.no_grad()
    def _talker(self) -> None:
        st, talker = self.st, self.model.talker
        x = self.talker_input[:, None]
        for kv in st.talker_kv:
            kv.at = st.position
        mask = None   # the fused path needs none
        if not talker.decoder.uses_kernels(st.talker_kv):
            mask = (st.key_positions[None, :] <= st.position[:, None])[:, None, None, :]
        hidden, logits = talker(x, st.position[:, None], mask, st.talker_kv)
        g0 = self.draw_g0(logits[:, -1].float(), st.talker_sampling, st.seen, st.min_new_tokens, st.seeds,
                          st.frame, frame_offset=1)
        self._advance(g0, hidden[:, -1])

    def _advance(self, g0: torch.Tensor, hidden: torch.Tensor) -> None:
        if self.kernels:
            from tts_kernels.advance import advance
            advance(self.st, self.emit, g0, hidden, self.codes, self.eos)
        else:
            advance_slots(self.st, self.emit, g0, hidden, self.codes, self.eos)

    def draw_g0(self, logits, rows, seen, min_new_tokens, seeds, frame, frame_offset: int = 0):
        """The codebook-0 draw of frame `frame` + frame_offset (frame: [B] or an int) after the
        talker's processors (repetition penalty over `seen`, EOS blocked below min_new_tokens,
        suppressed ids): one kernel with the sampler kernel on, else `process` then `draw`."""
        if self.sampler_kernel:
            from tts_kernels.sampler import TalkerProcessing, sample_rows
            processors = TalkerProcessing(seen, rows.repetition_penalty, min_new_tokens, self.process.suppressed,
                                          self.eos)
            return sample_rows(logits, rows.temperature, rows.top_k, rows.do_sample, seeds, frame, 0,
                               nonfinite=self.st.nonfinite, frame_offset=frame_offset, talker=processors)
        frame = frame + frame_offset
        processed = self.process(logits, seen, frame < min_new_tokens, rows.repetition_penalty)
        return self.draw(processed, rows, seeds, frame, 0)

    def draw(self, logits, rows, seeds, frame, group: int, noise=None):
        """tts_cli.model.sampler.choose, as one kernel when the sampler kernel is on. Either way NaN
        and +inf logits are counted into the state's `nonfinite` (runner: the run is refused)."""
        if self.sampler_kernel:
            from tts_kernels.sampler import sample_rows
            return sample_rows(logits, rows.temperature, rows.top_k, rows.do_sample, seeds, frame, group,
                               nonfinite=self.st.nonfinite)
        self.st.nonfinite.add_((logits.isnan() | logits.isposinf()).sum(dtype=torch.int32))
        return choose(logits, rows, seeds, frame, group, self.top_p, noise=noise)

    def _capture(self) -> None:
        """Warm up on a side stream, then capture each stage. Capturing runs the stages once with
        no slot active; the state they touch is reset by every admission."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                for name in STAGES:
                    self._run_fn(name)
        torch.cuda.current_stream().wait_stream(stream)
        pool = self.pool
        for name in STAGES:
            if name == "codec" and self.codec_stream is not None:
                # Replayed beside the others: a memory pool of its own, and warmed up and captured on
                # its stream, so that its cuBLAS workspace is that stream's (one per stream), not the steps'.
                self.codec_stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.codec_stream):
                    self._run_fn(name)
                torch.cuda.current_stream().wait_stream(self.codec_stream)
                self.graphs[name], _ = capture(functools.partial(self._run_fn, name), stream=self.codec_stream)
                continue
            graph, _ = capture(functools.partial(self._run_fn, name), pool)
            pool = self.pool = graph.pool()
            self.graphs[name] = graph
        self.st.window_column.zero_()   # the warm-up steps moved it; the host counts from column 0

    @torch.no_grad()
    def close_window(self, columns: int) -> None:
        """Ends the current window after only `columns` steps, for the runner to decode (once no slot
        emits, waiting for the rest would only step idle slots). The other columns still hold the
        previous window's frames: they become code 0, as for any slot that does not emit, and their
        PCM is not read. The next step starts a new window."""
        self.st.window_codes[:, columns:] = 0
        self.st.window_column.zero_()

    def run_stage(self, name: str) -> None:
        if self.graphs:
            self.graphs[name].replay()
        else:
            self._run_fn(name)
