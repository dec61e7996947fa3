"""The reference generation loop: prefill, then one talker step + one code-predictor frame per
12.5 Hz frame, for a batch of rows in lockstep. Plain and readable; the fast engine is tested
against it.

Frame f of a row: the talker output that predicted codebook 0 (g0[f]) plus the code predictor's
codebooks 1..15, computed at the start of the next talker step (as in the official model). A row
ends when it draws EOS as g0 (that frame is not emitted) or when it has max_frames frames.

The talker input of the step after frame f is the sum of the frame's 16 codebook embeddings plus a
text-track vector: the row's trailing text [f] in the streaming text mode while it lasts, else tts_pad.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tts_cli.errors import SynthesisCancelled
from tts_cli.model.qwen3_tts import Qwen3TTS
from tts_cli.model.transformer import GrowingKV, StaticKV
from tts_cli.model.sampler import RowSampling, SamplerSettings, TalkerLogitsProcessor, choose


@dataclass
class RowInput:
    prompt_embeds: torch.Tensor     # [L, H]
    seed: int
    max_frames: int
    teacher_codes: torch.Tensor | None = None   # [T, 16]: forced codes (parity tests)
    trailing_text: torch.Tensor | None = None   # [N, H]: streaming text mode, added to decode steps 0..N-1


@dataclass
class RowOutput:
    codes: torch.Tensor             # [frames, 16] int64
    hit_cap: bool
    # filled when generate(..., trace=True): raw logits / hidden states along the way
    talker_logits: list[torch.Tensor] = field(default_factory=list)   # [V] per talker output
    cp_logits: list[torch.Tensor] = field(default_factory=list)       # [15, V'] per frame
    past_hidden: list[torch.Tensor] = field(default_factory=list)     # [H] per talker output


def prefill_batch(prompts: list[torch.Tensor], left_pad: bool, columns: int | None = None):
    """Pads prompt embeddings [L_i, H] into one batch -> embeds [B, L, H], valid [B, L],
    positions [B, L] (each row's own 0, 1, ...), mask [B, 1, L, L]. Left padding (the official
    batch) ends every prompt at the last column; right padding starts every prompt at column 0.
    L is the longest prompt, or `columns` when given (>= the longest)."""
    longest = max([p.shape[0] for p in prompts] + [columns or 0])
    embeds = prompts[0].new_zeros(len(prompts), longest, prompts[0].shape[1])
    valid = torch.zeros(len(prompts), longest, dtype=torch.bool, device=prompts[0].device)
    for i, p in enumerate(prompts):
        columns = slice(longest - p.shape[0], longest) if left_pad else slice(0, p.shape[0])
        embeds[i, columns] = p
        valid[i, columns] = True
    positions = (valid.cumsum(1) - 1).clamp(min=0)
    causal = torch.ones(longest, longest, dtype=torch.bool, device=valid.device).tril()
    # Every query may see itself, so that padding rows stay finite (they are never attended).
    mask = (causal & valid[:, None, :]) | torch.eye(longest, dtype=torch.bool, device=valid.device)
    return embeds, valid, positions, mask[:, None]


@torch.no_grad()
def generate(model: Qwen3TTS, rows: list[RowInput], talker_sampler: SamplerSettings,
             cp_sampler: SamplerSettings, min_new_tokens: int = 2, trace: bool = False,
             static_caches: bool = False, cancel=None) -> list[RowOutput]:
    """min_new_tokens: EOS is blocked for the first min_new_tokens codebook-0 draws (the official
    model hard-codes 2; max_frames + 1 forces every row to its full length).
    static_caches: keys and values kept as the engine keeps them (StaticKV, in the weights' dtype),
    so that a model switched to its fused kernels (use_kernels) runs them: the engine's numbers
    without its scheduling. Needs prompts of one length (no padding: the kernels' attention is
    causal by cache position and reads no mask).
    cancel (a threading.Event): once set, SynthesisCancelled is raised before the next frame (a
    stopped run does not wait for a CPU batch's last frame)."""
    cfg = model.cfg
    talker, cp = model.talker, model.code_predictor
    device = talker.codec_embedding.weight.device
    b = len(rows)
    seeds = torch.tensor([r.seed for r in rows], dtype=torch.int64, device=device)
    process = TalkerLogitsProcessor(cfg.codec_vocab_size, cfg.codec_eos_id, device)
    talker_rows = RowSampling.uniform(talker_sampler, b, device)
    cp_rows = RowSampling.uniform(cp_sampler, b, device)
    pad_embed = talker.text_track(torch.tensor([cfg.tts_pad_id], device=device))   # [1, H]
    trailing = _trailing_text(rows, pad_embed)   # [B, N, H], padded with tts_pad (N >= 1)
    outputs = [RowOutput(codes=torch.empty(0, cfg.num_code_groups, dtype=torch.int64), hit_cap=False)
               for _ in rows]

    embeds, key_valid, positions, mask = prefill_batch([r.prompt_embeds for r in rows], left_pad=True)
    if static_caches:
        caches, cp_caches = _static_caches(model, rows), _static_caches(model, rows, depth=True)
    else:
        caches, cp_caches = [GrowingKV() for _ in talker.decoder.layers], None
    hidden, logits = talker(embeds, positions, mask, caches)
    next_position = key_valid.sum(1)

    seen = torch.zeros(b, cfg.codec_vocab_size, dtype=torch.bool, device=device)
    frames: list[list[torch.Tensor]] = [[] for _ in rows]
    done = torch.zeros(b, dtype=torch.bool)
    max_frames = torch.tensor([r.max_frames for r in rows])
    frame = 0
    while True:
        if cancel is not None and cancel.is_set():
            raise SynthesisCancelled()
        last_hidden, last_logits = hidden[:, -1], logits[:, -1].float()
        processed = process(last_logits, seen, torch.full((b,), frame < min_new_tokens, device=device),
                            talker_rows.repetition_penalty)
        code0 = choose(processed, talker_rows, seeds, frame, group=0)
        code0 = _teacher(rows, frame, 0, code0)
        seen[torch.arange(b, device=device), code0] = True
        if trace:
            for i, out in enumerate(outputs):
                out.talker_logits.append(last_logits[i].cpu())
                out.past_hidden.append(last_hidden[i].float().cpu())

        ended = (code0.cpu() == cfg.codec_eos_id) & ~done
        capped = (torch.tensor(frame) >= max_frames) & ~done & ~ended
        for i in torch.nonzero(capped).flatten().tolist():
            outputs[i].hit_cap = True
        done |= ended | capped
        if bool(done.all()):
            break

        code0_embed = talker.codec_track(code0)
        teacher = _teacher_frame(rows, frame)
        codes, cp_logits = cp.predict_frame(
            last_hidden, code0_embed,
            choose=lambda group, lg: choose(lg, cp_rows, seeds, frame, group),
            forced_codes=teacher, caches=cp_caches)
        for i in torch.nonzero(~done).flatten().tolist():
            frames[i].append(torch.cat((code0[i:i + 1], codes[i])).cpu())
            if trace:
                outputs[i].cp_logits.append(cp_logits[i].cpu())

        text_embed = trailing[:, frame] if frame < trailing.shape[1] else pad_embed
        step_embed = cp.frame_embedding(code0_embed, codes) + text_embed
        key_valid = torch.cat((key_valid, torch.ones(b, 1, dtype=torch.bool, device=device)), dim=1)
        for cache in caches:
            cache.at = key_valid.shape[1] - 1   # GrowingKV: its length already; StaticKV: where to write
        hidden, logits = talker(step_embed[:, None], next_position[:, None], key_valid[:, None, None, :], caches)
        next_position = next_position + 1
        frame += 1

    for out, row_frames in zip(outputs, frames):
        if row_frames:
            out.codes = torch.stack(row_frames)
    return outputs


def _trailing_text(rows: list[RowInput], pad_embed: torch.Tensor) -> torch.Tensor:
    """Each row's trailing text vectors, right-padded with tts_pad to the longest (as the official
    batch pads them): [B, N, H], N >= 1."""
    longest = max([1] + [r.trailing_text.shape[0] for r in rows if r.trailing_text is not None])
    trailing = pad_embed.expand(len(rows), longest, -1).clone()
    for i, r in enumerate(rows):
        if r.trailing_text is not None:
            trailing[i, :r.trailing_text.shape[0]] = r.trailing_text
    return trailing


def _static_caches(model: Qwen3TTS, rows: list[RowInput], depth: bool = False) -> list[StaticKV]:
    lengths = {r.prompt_embeds.shape[0] for r in rows}
    if len(lengths) > 1:
        raise ValueError("static caches need prompts of one length")
    cfg = model.cfg.code_predictor if depth else model.cfg.talker
    capacity = model.cfg.num_code_groups if depth else lengths.pop() + max(r.max_frames for r in rows) + 1
    weight = model.talker.codec_embedding.weight
    return [StaticKV(len(rows), cfg.num_kv_heads, capacity, cfg.head_dim, weight.device, weight.dtype)
            for _ in range(cfg.num_layers)]


def _teacher(rows: list[RowInput], frame: int, group: int, chosen: torch.Tensor) -> torch.Tensor:
    """Replaces chosen codes by teacher codes for rows that have one at this frame."""
    for i, r in enumerate(rows):
        if r.teacher_codes is not None and frame < r.teacher_codes.shape[0]:
            chosen = chosen.clone()
            chosen[i] = r.teacher_codes[frame, group]
    return chosen


def _teacher_frame(rows: list[RowInput], frame: int) -> torch.Tensor | None:
    if all(r.teacher_codes is None for r in rows):
        return None
    if any(r.teacher_codes is None or frame >= r.teacher_codes.shape[0] for r in rows):
        raise ValueError("teacher forcing needs teacher codes for every row and frame")
    return torch.stack([r.teacher_codes[frame, 1:] for r in rows]).to(rows[0].prompt_embeds.device)
