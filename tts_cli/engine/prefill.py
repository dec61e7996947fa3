"""The engine's prefill: one talker call over the prompts of every newly admitted request, writing
their keys and values straight into their slots' static caches, and returning each prompt's last
hidden state and codebook-0 logits.

On CUDA each call shape is a CUDA graph: an eager prefill launches some 400 kernels from Python
(measured on the H200: 24 ms for 8 prompts, whatever their length), more than the GPU work.
Shapes are bucketed so that few graphs serve every admission: rows up to the next power of two
(extra rows repeat the first request: they write the same values to the same cache rows), prompt
columns up to a multiple of COLUMN_BUCKET (right padding, as in the eager call: padded columns
lie beyond every prompt and are overwritten before a query sees them). Graphs are captured on
first use.
"""
from __future__ import annotations

import torch

from tts_cli.engine.slots import SlotState
from tts_cli.model.generate import prefill_batch

COLUMN_BUCKET = 32


class Prefill:
    def __init__(self, model, state: SlotState, use_graphs: bool):
        self.talker, self.state, self.use_graphs = model.talker, state, use_graphs
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict, tuple]] = {}
        self.pool = None

    @torch.no_grad()
    def __call__(self, prompts: list[torch.Tensor], slots: torch.Tensor, lengths: torch.Tensor):
        """prompts: [L_i, H] each; slots, lengths [n] on the device. -> (hidden [n, H], logits [n, V] fp32)."""
        if not self.use_graphs:
            embeds, _, positions, mask = prefill_batch(prompts, left_pad=False)
            return self._forward(embeds, positions, mask, slots, lengths)
        n = len(prompts)
        rows = min(1 << (n - 1).bit_length(), self.state.rows)
        longest = max(p.shape[0] for p in prompts)
        columns = min(-(-longest // COLUMN_BUCKET) * COLUMN_BUCKET, self.state.context)
        embeds, _, positions, mask = prefill_batch(prompts, left_pad=False, columns=columns)
        pad = torch.zeros(rows - n, dtype=torch.long, device=slots.device)
        inputs = {"embeds": embeds, "positions": positions, "mask": mask, "slots": slots, "lengths": lengths}
        inputs = {name: torch.cat([t, t[pad]]) for name, t in inputs.items()}
        if (rows, columns) not in self.graphs:
            self.graphs[rows, columns] = self._capture(inputs)
        graph, buffers, outputs = self.graphs[rows, columns]
        for name, t in inputs.items():
            buffers[name].copy_(t)
        graph.replay()
        return outputs[0][:n], outputs[1][:n]

    def _forward(self, embeds, positions, mask, slots, lengths):
        caches = [kv.for_rows(slots) for kv in self.state.talker_kv]
        hidden = self.talker.decoder(embeds, positions, mask, caches)
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
        return last, self.talker.codec_head(last).float()

    def _capture(self, inputs: dict):
        buffers = {name: t.clone() for name, t in inputs.items()}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(**buffers)   # warm-up (Triton compiles, cuBLAS picks its kernels)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self._forward(**buffers)
        self.pool = graph.pool()
        return graph, buffers, outputs
