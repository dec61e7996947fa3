"""The decode step's bookkeeping on the slots, each part as one Triton kernel instead of a run of
small torch ones (each a launch in the step's graph):
- `start_frame`: which slots emit at this step, and the embedding of each slot's codebook-0 code
  (tts_cli.engine.step.start_frame_slots, the reference: eight torch kernels);
- `emit_frame`: the end of the depth stage: the frame's codes into the codec window, and the
  talker's next input (the sum of the frame's 16 codebook embeddings and a text vector: tts_pad's,
  or each slot's trailing text in the streaming text mode)
  (emit_frame_slots: some twelve);
- `advance`: the end of the talker stage: each slot that emitted a frame takes its new codebook-0
  draw and talker state, marks the draw as seen (repetition penalty), moves its position and frame
  count on, and every slot says whether it emits at the next step (advance_slots: some eighteen)."""
import torch
import triton
import triton.language as tl

from tts_kernels.launch import let_dependents_launch, programmatic, wait_for_predecessor


@triton.jit
def _emits(active, g0, eos, frame, cap):
    """Whether a slot emits a frame at the step about to run (tts_cli.engine.step.emits_next)."""
    return active & (g0 != eos) & (frame < cap)


@triton.jit
def _start_frame(g0_ptr, active_ptr, frame_ptr, cap_ptr, table_ptr, emit_ptr, code0_ptr, width, eos,
                 BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    let_dependents_launch(PDL)
    wait_for_predecessor(PDL)
    g0 = tl.load(g0_ptr + row)
    emit = _emits(tl.load(active_ptr + row) != 0, g0, eos, tl.load(frame_ptr + row), tl.load(cap_ptr + row))
    tl.store(emit_ptr + row, emit.to(tl.int8))
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        embedding = tl.load(table_ptr + g0 * width + cols, mask=cols < width).to(tl.float32)
        tl.store(code0_ptr + row * width + cols, embedding, mask=cols < width)


def start_frame(state, table: torch.Tensor, emit: torch.Tensor, code0_embed: torch.Tensor, eos: int) -> None:
    """emit [B] bool <- which slots of `state` (the engine's SlotState) emit at this step;
    code0_embed [B, H] fp32 <- the rows of `table` (the talker's codec embedding) at their g0."""
    rows, width = code0_embed.shape
    assert table.is_contiguous() and code0_embed.is_contiguous()
    _start_frame[(rows,)](state.g0, state.active.view(torch.int8), state.frame, state.cap, table,
                          emit.view(torch.int8), code0_embed, width, eos,
                          BLOCK=min(1024, triton.next_power_of_2(width)), **programmatic(code0_embed))


@triton.jit
def _emit_frame(emit_ptr, g0_ptr, residual_ptr, residual_stride, codes_ptr, window_ptr, column_ptr, columns,
                tables_ptr, vocab, code0_ptr, text_ptr, text_stride, talker_input_ptr, groups, width,
                GROUPS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    group = tl.arange(0, GROUPS)
    let_dependents_launch(PDL)
    wait_for_predecessor(PDL)
    # a slot that stopped holds EOS as g0, which is no codec code: it decodes code 0 instead
    g0 = tl.where(tl.load(emit_ptr + row) != 0, tl.load(g0_ptr + row), 0)
    residual = tl.load(residual_ptr + row * residual_stride + group - 1, mask=(group >= 1) & (group < groups),
                       other=0)
    codes = tl.where(group == 0, g0, residual)
    tl.store(codes_ptr + row * groups + group, codes, mask=group < groups)
    tl.store(window_ptr + (row * columns + tl.load(column_ptr)) * groups + group, codes, mask=group < groups)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < width
        total = tl.load(code0_ptr + row * width + cols, mask=valid, other=0.0)
        for j in range(1, groups):   # in order (torch sums the stacked rows in an order of its own)
            code = tl.load(residual_ptr + row * residual_stride + j - 1)
            embedding = tl.load(tables_ptr + ((j - 1) * vocab + code) * width + cols, mask=valid, other=0.0)
            total += embedding.to(tl.float32)
        text = tl.load(text_ptr + row * text_stride + cols, mask=valid, other=0.0)
        tl.store(talker_input_ptr + row * width + cols, total + text, mask=valid)


def emit_frame(state, emit: torch.Tensor, residual: torch.Tensor, codes: torch.Tensor, tables: torch.Tensor,
               code0_embed: torch.Tensor, text_embed: torch.Tensor, talker_input: torch.Tensor) -> None:
    """codes [B, G] <- the frame's codes (emit [B]: codebook 0 from the state's g0 where the slot
    emits, else 0; residual [B, G - 1] int64, rows may be strided), also into the state's codec
    window at its column; talker_input [B, H] fp32 <- code0_embed + the embeddings of the residual
    codes (tables [(G - 1) V, H]: codebook j's at rows j V ...) + the text vector: text_embed [1, H]
    (tts_pad's, every row) or [B, H] (each row's)."""
    rows, groups = codes.shape
    width = talker_input.shape[1]
    assert residual.stride(1) == 1 and tables.is_contiguous() and code0_embed.is_contiguous()
    assert text_embed.dim() == 2 and text_embed.stride(1) == 1 and text_embed.shape[0] in (1, rows)
    _emit_frame[(rows,)](emit.view(torch.int8), state.g0, residual, residual.stride(0), codes, state.window_codes,
                         state.window_column, state.window_codes.shape[1], tables, tables.shape[0] // (groups - 1),
                         code0_embed, text_embed, text_embed.stride(0) if text_embed.shape[0] > 1 else 0,
                         talker_input, groups, width,
                         GROUPS=triton.next_power_of_2(groups), BLOCK=min(1024, triton.next_power_of_2(width)),
                         **programmatic(talker_input))


@triton.jit
def _advance(emit_ptr, drawn_ptr, new_hidden_ptr, new_hidden_stride, codes_ptr, g0_ptr, hidden_ptr, position_ptr,
             frame_ptr, cap_ptr, active_ptr, seen_ptr, out_codes_ptr, out_emit_ptr, rows, groups, vocab, width,
             eos, GROUPS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    group = tl.arange(0, GROUPS)
    let_dependents_launch(PDL)
    wait_for_predecessor(PDL)
    emit_byte = tl.load(emit_ptr + row)
    emit = emit_byte != 0
    tl.store(out_codes_ptr + row * groups + group, tl.load(codes_ptr + row * groups + group, mask=group < groups),
             mask=group < groups)
    tl.store(out_emit_ptr + row, emit.to(tl.int8))
    drawn = tl.load(drawn_ptr + row)
    seen = seen_ptr + row * vocab + drawn
    tl.store(seen, tl.load(seen) | emit.to(tl.int8))
    g0 = tl.where(emit, drawn, tl.load(g0_ptr + row))
    tl.store(g0_ptr + row, g0)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = (cols < width) & (tl.zeros([BLOCK], tl.int8) + emit_byte != 0)   # (the interpreter: no scalar here)
        tl.store(hidden_ptr + row * width + cols,
                 tl.load(new_hidden_ptr + row * new_hidden_stride + cols, mask=valid), mask=valid)
    step = emit.to(tl.int64)
    tl.store(position_ptr + row, tl.load(position_ptr + row) + step)
    frame = tl.load(frame_ptr + row) + step
    tl.store(frame_ptr + row, frame)
    emits_next = _emits(tl.load(active_ptr + row) != 0, g0, eos, frame, tl.load(cap_ptr + row))
    tl.store(out_emit_ptr + rows + row, emits_next.to(tl.int8))
    tl.store(out_emit_ptr + 2 * rows + row, (g0 == eos).to(tl.int8))


def advance(state, emit: torch.Tensor, drawn: torch.Tensor, new_hidden: torch.Tensor, codes: torch.Tensor,
            eos: int) -> None:
    """state: the engine's SlotState, updated in place; emit [B] bool (the slots that emitted this
    step's frame), drawn [B] int64 (the next codebook-0 draw), new_hidden [B, H] fp32 (rows may be
    strided), codes [B, G] int64 (the frame's codes, for out_codes)."""
    rows, width = state.hidden.shape
    groups = codes.shape[1]
    assert new_hidden.stride(1) == 1 and codes.is_contiguous() and state.out_emit.is_contiguous()
    as_bytes = [t.view(torch.int8) for t in (emit, state.active, state.seen, state.out_emit)]
    _advance[(rows,)](as_bytes[0], drawn, new_hidden, new_hidden.stride(0), codes, state.g0, state.hidden,
                      state.position, state.frame, state.cap, as_bytes[1], as_bytes[2], state.out_codes,
                      as_bytes[3], rows, groups, state.seen.shape[1], width, eos,
                      GROUPS=triton.next_power_of_2(groups), BLOCK=min(1024, triton.next_power_of_2(width)),
                      **programmatic(state.hidden))
