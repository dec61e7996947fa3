"""Per-slot device state of the engine: fixed-address buffers that the decode step (a CUDA graph
on GPU) reads and updates, and that admission writes between steps.

A slot holds one request from admission until it ends. `g0` is the codebook-0 code of the frame
the slot emits next and `hidden` the talker state that predicted it; the step emits that frame
(codebooks 1..15 from the code predictor, its PCM from the streamed codec) and draws the next g0.
A slot whose g0 is EOS, or that has `cap` frames, stops emitting and stays frozen until the host
frees it.

The codec decodes every `codec_window` (K) steps over the last K frames of every slot: the step
writes its frame into `window_codes` at column `window_column` (step mod K, kept on the device so
that one captured graph serves every column). Requests are admitted at window boundaries only, so
a slot's frames in a window always start at column 0 and belong to one request.

In the streaming text mode a request's text goes on past its prompt, one text vector added to each
decode step's input (the trailing text). An engine built for it holds every slot's trailing
vectors in `trailing_text` [rows, context, H], written at admission; frame f of a slot adds row f of
its vectors while f < `trailing_length`, tts_pad's after (and always, for a request without any).
Indexing by the slot's frame count keeps the step free of host work and its shapes fixed; a
request never has more frames than its slot has positions, so `context` vectors always suffice.

A tail step (runner: the ragged end of a run) runs on `head(n)`, the first n slots: views of the
same buffers, with outputs of its own; `move` first brings the requests still speaking there.
"""
from __future__ import annotations

import copy
from dataclasses import fields, replace

import torch

from tts_cli.checkpoint import ModelConfig
from tts_cli.model.sampler import RowSampling, SamplerSettings
from tts_cli.model.transformer import StaticKV


def talker_kv_bytes(cfg: ModelConfig, rows: int, context: int, dtype: torch.dtype, trailing_text: bool = False) -> int:
    """Bytes of the talker's static keys and values for `rows` slots of `context` positions, plus
    with `trailing_text` the slots' trailing text vectors (fp32): the memory that grows with the
    workload (the code predictor's caches hold 16 positions)."""
    t = cfg.talker
    kv = 2 * t.num_layers * rows * t.num_kv_heads * context * t.head_dim * dtype.itemsize
    return kv + (rows * context * t.hidden_size * 4 if trailing_text else 0)


def most_positions(cfg: ModelConfig, rows: int, trailing_text: bool = False) -> int:
    """The most talker positions per slot whose caches (and trailing text vectors) the kernels can
    address: their element offsets (slot x slot stride + ...) are int32, and past 2^31 elements they
    would wrap into other slots' keys."""
    t = cfg.talker
    return (2**31 - 1) // (rows * max(t.num_kv_heads * t.head_dim, t.hidden_size if trailing_text else 0))


class SlotState:
    def __init__(self, cfg: ModelConfig, rows: int, context: int, codec, device, kv_dtype,
                 talker_defaults: SamplerSettings, cp_defaults: SamplerSettings, codec_window: int = 1,
                 trailing_text: bool = False):
        t, cp = cfg.talker, cfg.code_predictor
        most = most_positions(cfg, rows, trailing_text)
        if context > most:
            raise ValueError(f"{rows} rows x {context} positions: past the {most} positions a slot's caches may hold "
                             "at that many rows (the kernels' offsets are int32); use fewer rows or shorter segments")

        def longs():
            return torch.zeros(rows, dtype=torch.int64, device=device)

        self.rows, self.context = rows, context
        self.g0 = longs()
        self.hidden = torch.zeros(rows, t.hidden_size, device=device)   # fp32, as every activation
        self.position = longs()          # talker position of the slot's next input
        self.frame = longs()             # frames emitted so far
        self.cap = longs()
        self.min_new_tokens = longs()
        self.seeds = longs()
        self.active = torch.zeros(rows, dtype=torch.bool, device=device)
        self.seen = torch.zeros(rows, cfg.codec_vocab_size, dtype=torch.bool, device=device)
        self.talker_sampling = RowSampling.uniform(talker_defaults, rows, device)
        self.cp_sampling = RowSampling.uniform(cp_defaults, rows, device)
        # every layer's keys and values in one buffer, so that one copy writes a voice prefix into all
        self.talker_cache = torch.zeros(2, t.num_layers, rows, t.num_kv_heads, context, t.head_dim, device=device,
                                        dtype=kv_dtype)
        self.talker_kv = [StaticKV(rows, t.num_kv_heads, context, t.head_dim, device, kv_dtype,
                                   buffers=(self.talker_cache[0, i], self.talker_cache[1, i]))
                          for i in range(t.num_layers)]
        self.cp_kv = [StaticKV(rows, cp.num_kv_heads, cfg.num_code_groups, cp.head_dim, device, kv_dtype)
                      for _ in range(cp.num_layers)]
        self.key_positions = torch.arange(context, device=device)
        self.trailing_text = torch.zeros(rows, context, t.hidden_size, device=device) if trailing_text else None
        self.trailing_length = longs()
        self.codec = codec.new_state(rows)
        self.window_codes = torch.zeros(rows, codec_window, cfg.num_code_groups, dtype=torch.int64, device=device)
        self.window_column = torch.zeros(1, dtype=torch.int64, device=device)
        self.codec_codes = torch.zeros_like(self.window_codes)   # what the codec decodes: the window, copied
        # outputs of the last step (PCM: of the last window), copied to pinned host memory by the runner
        self.out_codes = torch.zeros(rows, cfg.num_code_groups, dtype=torch.int64, device=device)
        self.out_pcm = torch.zeros(rows, codec_window * codec.samples_per_frame, device=device)
        # [0]: the slot emitted a frame at the last step; [1]: it emits one at the next; [2]: its next
        # codebook-0 draw is EOS (a slot that stops on its cap frame and EOS at once ended on EOS)
        self.out_emit = torch.zeros(3, rows, dtype=torch.bool, device=device)
        # NaN and +inf logits met by the draws since the run began (the engine refuses the run's audio)
        self.nonfinite = torch.zeros(1, dtype=torch.int32, device=device)

    def admit(self, slots: torch.Tensor, *, g0: torch.Tensor, hidden: torch.Tensor, prompt_lengths: torch.Tensor,
              caps: torch.Tensor, min_new_tokens: torch.Tensor, seeds: torch.Tensor, talker: RowSampling,
              cp: RowSampling, trailing_text: torch.Tensor | None = None,
              trailing_lengths: torch.Tensor | None = None) -> None:
        """Start requests in `slots` [n] (their prompts' keys and values are already written); every
        argument has one row per slot, on the device; trailing_text [n, N, H] (N <= context) and
        trailing_lengths [n]: their trailing text vectors, right-padded (None: none). Vectorized:
        a few kernels for any n. Their codec state is the runner's to reset or prime (on the
        codec's stream, where it has one).

        Constants go in as fill kernels (index_fill_, fill_), never as Python values assigned
        through an index (`t[slots] = 0`): torch sends those to the GPU as a blocking copy, which
        makes the host wait for the step still running (the H200 idled 0.5-0.65 ms per such wait
        at 64 rows: tools/run_profile.py, docs/bench.md)."""
        self.g0[slots] = g0
        self.hidden[slots] = hidden
        self.position[slots] = prompt_lengths
        self.frame.index_fill_(0, slots, 0)
        self.cap[slots] = caps
        self.min_new_tokens[slots] = min_new_tokens
        self.seeds[slots] = seeds
        self.active.index_fill_(0, slots, True)
        self.seen.index_fill_(0, slots, False)
        self.seen[slots, g0] = torch.ones_like(g0, dtype=torch.bool)
        self.talker_sampling.assign(slots, talker)
        self.cp_sampling.assign(slots, cp)
        if trailing_text is None:
            self.trailing_length.index_fill_(0, slots, 0)
        else:
            self.trailing_text[slots, :trailing_text.shape[1]] = trailing_text
            self.trailing_length[slots] = trailing_lengths

    def _slot_tensors(self) -> list[torch.Tensor]:
        """Every tensor that holds per-slot state with slots along dim 0 (outputs and scratch excluded);
        the talker's caches (`talker_cache`, slots along dim 2) aside."""
        tensors = [self.g0, self.hidden, self.position, self.frame, self.cap, self.min_new_tokens, self.seeds,
                   self.active, self.seen, self.trailing_length, self.window_codes, self.codec.position,
                   *self.codec.history.values()]
        tensors += [getattr(sampling, f.name) for sampling in (self.talker_sampling, self.cp_sampling)
                    for f in fields(sampling)]
        if self.trailing_text is not None:
            tensors.append(self.trailing_text)
        return tensors

    def move(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """The state of slots `source` [n] (int64, on the device) to slots `target` [n], none in both;
        the source slots end inactive. The code predictor's caches are not moved: each frame rewrites
        them before reading."""
        for t in self._slot_tensors():
            t.index_copy_(0, target, t.index_select(0, source))
        for layer in self.talker_cache.unbind(1):   # a layer's keys and values at a time (all at once: a copy of
            layer.index_copy_(1, target, layer.index_select(1, source))   # up to half the cache, unbudgeted)
        self.active.index_fill_(0, source, False)

    def head(self, rows: int) -> "SlotState":
        """The first `rows` slots as a SlotState of their own: views of these buffers (so a step on it
        updates them), with outputs of its own (the runner copies each step's outputs whole)."""
        head = copy.copy(self)
        head.rows = rows
        for name in ("g0", "hidden", "position", "frame", "cap", "min_new_tokens", "seeds", "active", "seen",
                     "trailing_length", "window_codes", "codec_codes"):
            setattr(head, name, getattr(self, name)[:rows])
        if self.trailing_text is not None:
            head.trailing_text = self.trailing_text[:rows]
        head.talker_sampling, head.cp_sampling = (
            replace(s, **{f.name: getattr(s, f.name)[:rows] for f in fields(s)})
            for s in (self.talker_sampling, self.cp_sampling))
        head.talker_kv = [kv.first_rows(rows) for kv in self.talker_kv]
        head.cp_kv = [kv.first_rows(rows) for kv in self.cp_kv]
        head.codec = replace(self.codec, position=self.codec.position[:rows],
                             history={name: t[:rows] for name, t in self.codec.history.items()})
        head.out_codes = torch.zeros_like(self.out_codes[:rows])
        head.out_pcm = torch.zeros_like(self.out_pcm[:rows])
        head.out_emit = torch.zeros_like(self.out_emit[:, :rows])
        return head

    def clear(self) -> None:
        """Every slot free and every buffer zero, as built: after a run that failed part-way, whose
        state could otherwise reach the next run (a window left half-filled at its column; a row's NaN
        in its slot's hidden state and caches, which the next run's steps, computing every slot,
        would count as its own)."""
        for t in [*self._slot_tensors(), self.talker_cache, *(t for kv in self.cp_kv for t in (kv.k, kv.v)),
                  self.window_column, self.codec_codes, self.out_codes, self.out_pcm, self.out_emit, self.nonfinite]:
            t.zero_()

    def release(self, slot: int) -> None:
        self.active.narrow(0, slot, 1).fill_(False)   # not `active[slot] = False`: see admit
