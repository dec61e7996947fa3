"""The engine's loop: admit -> prefill -> decode step -> drain, over a fixed number of row slots
that are refilled from a queue as requests end.

The host never waits inside a step: after launching step n it reads step n-1's outputs from
pinned memory (waiting only on that step's event), ends finished requests, and admits new ones
into the freed slots before launching step n+1.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from tts_cli.engine.slots import SlotState
from tts_cli.engine.step import STAGES, DecodeStep
from tts_cli.errors import RequestError
from tts_cli.model.generate import prefill_batch
from tts_cli.model.sampler import RowSampling, SamplerSettings, choose
from tts_cli.model.transformer import use_kernels

log = logging.getLogger(__name__)


@dataclass
class EngineRequest:
    key: int                        # the caller's index for this request
    prompt_embeds: torch.Tensor     # [L, H] on the engine's device
    seed: int
    max_frames: int
    min_new_tokens: int = 2
    talker: SamplerSettings | None = None   # None: the engine's defaults
    cp: SamplerSettings | None = None


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


@dataclass
class _Running:
    request: EngineRequest
    admitted_at: float
    codes: list = field(default_factory=list)
    pcm: list = field(default_factory=list)
    first_audio_at: float | None = None


@dataclass
class EngineStats:
    steps: int = 0
    stage_ms: dict = field(default_factory=lambda: {name: 0.0 for name in STAGES})
    prefill_ms: float = 0.0
    wall_s: float = 0.0

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
    use_kernels(model, on)
    use_kernels(codec, on)
    return on


class Engine:
    def __init__(self, model, codec, rows: int, context: int, talker_defaults: SamplerSettings,
                 cp_defaults: SamplerSettings, use_graphs: bool | None = None, top_p: bool = False,
                 time_stages: bool = False, fused_kernels: bool | None = None):
        device = model.talker.codec_embedding.weight.device
        dtype = model.talker.codec_embedding.weight.dtype
        if use_graphs is None:
            use_graphs = device.type == "cuda"
        if not use_graphs:
            log.info("engine: CUDA graphs off (%s): each step runs eagerly", device.type)
        self.model, self.codec, self.device = model, codec, device
        use_fused_kernels(model, codec, device, fused_kernels)
        self.rows, self.context = rows, context
        self.admit_group = max(1, rows // 8)
        self.talker_defaults, self.cp_defaults = talker_defaults, cp_defaults
        self.state = SlotState(model.cfg, rows, context, codec, device, dtype, talker_defaults, cp_defaults)
        self.step = DecodeStep(model, codec, self.state, use_graphs, top_p)
        self.process = self.step.process   # the prefill's first draw uses the step's processors
        self.time_stages = time_stages and device.type == "cuda"
        pin = device.type == "cuda"
        self._host = [self._host_buffers(pin) for _ in range(2)]
        self.stats = EngineStats()
        self._pending_times: list = []

    def _host_buffers(self, pin: bool):
        st = self.state
        return {name: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
                for name, t in (("codes", st.out_codes), ("pcm", st.out_pcm), ("emit", st.out_emit))}

    # -- admission ------------------------------------------------------------------------------

    def check(self, request: EngineRequest) -> None:
        """A request whose prompt plus frame cap can never fit a slot is refused, not queued."""
        need = request.prompt_embeds.shape[0] + request.max_frames + 1
        if need > self.context:
            raise RequestError(f"prompt ({request.prompt_embeds.shape[0]} positions) plus frame cap "
                               f"({request.max_frames}) needs {need} talker positions; this engine's slots "
                               f"hold {self.context}")

    @torch.no_grad()
    def _prefill(self, admitted: list[tuple[int, EngineRequest]]) -> None:
        """One padded talker call for every newly admitted request; keys and values go to the
        slots' static caches, the first codebook-0 draw to the slot state."""
        requests = [r for _, r in admitted]
        embeds, valid, positions, mask = prefill_batch([r.prompt_embeds for r in requests], left_pad=False)
        # Everything the host knows goes over in one pinned, non-blocking copy: a plain
        # torch.tensor(..., device=cuda) would wait for the step that is still running.
        host = torch.tensor([[slot, r.prompt_embeds.shape[0], r.max_frames, r.min_new_tokens, r.seed]
                             for slot, r in admitted], dtype=torch.int64)
        if self.device.type == "cuda":
            host = host.pin_memory()
        slots, lengths, caps, min_new_tokens, seeds = host.to(self.device, non_blocking=True).unbind(1)
        # Right-padded prompts write their keys and values straight into the slots' caches: the
        # padding's entries lie beyond each prompt and are overwritten before any query sees them.
        caches = [kv.for_rows(slots) for kv in self.state.talker_kv]
        hidden, logits = self.model.talker(embeds, positions, mask, caches)
        rows = torch.arange(len(requests), device=self.device)
        last_hidden, last_logits = hidden[rows, lengths - 1], logits[rows, lengths - 1].float()
        talker = RowSampling.stack([r.talker or self.talker_defaults for r in requests], self.device)
        cp = RowSampling.stack([r.cp or self.cp_defaults for r in requests], self.device)
        seen = torch.zeros(len(requests), self.model.cfg.codec_vocab_size, dtype=torch.bool, device=self.device)
        processed = self.process(last_logits, seen, min_new_tokens > 0, talker.repetition_penalty)
        g0 = choose(processed, talker, seeds, 0, 0)
        self.state.admit(slots, g0=g0, hidden=last_hidden, prompt_lengths=lengths, caps=caps,
                         min_new_tokens=min_new_tokens, seeds=seeds, talker=talker, cp=cp)

    # -- the loop ---------------------------------------------------------------------------------

    def run(self, requests: list[EngineRequest], on_result=None) -> list[EngineResult]:
        """Synthesizes every request; results in request order (on_result sees each as it ends)."""
        for r in requests:
            self.check(r)
        queue = deque(requests)
        running: list[_Running | None] = [None] * self.rows
        results: dict[int, EngineResult] = {}
        previous = None   # (host buffers, event, slot owners) of the step whose outputs are unread
        parity = 0
        start = time.perf_counter()
        while True:
            free = [i for i, r in enumerate(running) if r is None]
            admitted = []
            # Prefill is an eager call of a few ms whatever its size: admit in groups, not one
            # request per step, unless nothing runs or the queue is nearly empty.
            if len(free) >= min(self.admit_group, len(queue)) or all(r is None for r in running):
                while free and queue:
                    admitted.append((free.pop(0), queue.popleft()))
            if admitted:
                t0 = self._event()
                self._prefill(admitted)
                now = time.perf_counter()
                for slot, r in admitted:
                    running[slot] = _Running(r, now)
                self._add_time("prefill", t0)
            launched = None
            if any(r is not None for r in running):
                buffers = self._host[parity]
                parity ^= 1
                self._launch_step(buffers)
                launched = (buffers, self._record_event(), list(running))
            if previous is not None:
                self._drain(*previous, running, results, on_result)
            previous = launched
            if previous is None and not queue and all(r is None for r in running):
                break
        self.stats.wall_s += time.perf_counter() - start
        return [results[r.key] for r in requests]

    def _launch_step(self, buffers) -> None:
        st = self.state
        for name in STAGES:
            t0 = self._event()
            self.step.run_stage(name)
            self._add_time(name, t0)
        self.stats.steps += 1
        buffers["codes"].copy_(st.out_codes, non_blocking=True)
        buffers["pcm"].copy_(st.out_pcm, non_blocking=True)
        buffers["emit"].copy_(st.out_emit, non_blocking=True)

    def _drain(self, buffers, event, owners, running, results, on_result) -> None:
        """Reads one finished step: appends emitted frames, ends the requests that stopped. A slot
        counts only if it still holds the request it held when the step was launched."""
        if event is not None:
            event.synchronize()
        now = time.perf_counter()
        emit, codes, pcm = (buffers[name].numpy() for name in ("emit", "codes", "pcm"))
        for slot, run in enumerate(running):
            if run is None or run is not owners[slot]:
                continue
            if emit[slot]:
                run.codes.append(codes[slot].copy())
                run.pcm.append(pcm[slot].copy())
                if run.first_audio_at is None:
                    run.first_audio_at = now
                continue
            frames = len(run.codes)
            result = EngineResult(
                key=run.request.key,
                codes=np.stack(run.codes) if run.codes else np.zeros((0, codes.shape[1]), dtype=np.int64),
                pcm=np.concatenate(run.pcm) if run.pcm else np.zeros(0, dtype=np.float32),
                hit_cap=frames >= run.request.max_frames, admitted_at=run.admitted_at,
                first_audio_at=run.first_audio_at, finished_at=now)
            results[run.request.key] = result
            running[slot] = None
            self.state.release(slot)
            if on_result is not None:
                on_result(result)

    # -- timing -------------------------------------------------------------------------------------

    def reset_stats(self) -> None:
        self.stats = EngineStats()
        self._pending_times.clear()

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
