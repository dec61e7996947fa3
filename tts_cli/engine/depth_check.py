"""The persistent depth kernel (tts_kernels.depth_frame) against the code-predictor loop on the same
inputs with given codes: what `tts verify-golden` checks on a GPU where the kernel runs, and what
tools/depth_bench.py reports."""
from __future__ import annotations

import torch

from tts_cli.model.transformer import StaticKV

POSITIONS = 16   # the code predictor's positions per frame (tts_kernels.depth_schedule.POSITIONS)


def kernel_unsupported(cp, rows: int) -> str | None:
    """Why the persistent depth kernel cannot run for this code predictor and rows here, or None.
    Imports Triton only where the kernels can run (it is an optional dependency)."""
    import tts_kernels
    ok, why = tts_kernels.available(cp.decoder.norm.weight.device.type)
    if not ok:
        return why
    from tts_kernels.depth_frame import unsupported
    return unsupported(cp, rows)


@torch.no_grad()
def kernel_against_loop(cp, hidden: torch.Tensor, code0_embed: torch.Tensor, given_codes: torch.Tensor,
                        kernel=None) -> dict:
    """hidden, code0_embed [B, talker hidden]; given_codes [B, 15]. Both sides take the given codes
    as their inputs; returns the kernel's largest logit difference over the loop's largest logit,
    and the share of the 15 x B greedy codes (argmax) the two sets of logits agree on. kernel: a
    DepthFrame of at least B rows (default: a new one)."""
    from tts_kernels.depth_frame import DepthFrame

    rows = hidden.shape[0]
    cfg = cp.decoder.cfg
    weight = cp.decoder.layers[0].mlp.down_proj.weight
    caches = [StaticKV(rows, cfg.num_kv_heads, POSITIONS, cfg.head_dim, weight.device, weight.dtype)
              for _ in cp.decoder.layers]
    _, loop_logits = cp.predict_frame(hidden, code0_embed, None, forced_codes=given_codes, caches=caches)
    kernel = kernel or DepthFrame(cp, rows)
    unused = torch.zeros(rows, dtype=torch.int64, device=hidden.device)   # the draws are skipped
    kernel.run(cp.input_projection(torch.stack((hidden, code0_embed))), torch.ones(rows, device=hidden.device),
               unused, unused.bool(), unused, unused, forced_codes=given_codes, store_logits=True)
    kernel_logits = kernel.logits[:rows]
    return dict(logit_error_of_max=float((kernel_logits - loop_logits).abs().max() / loop_logits.abs().max()),
                greedy_agreement=float((kernel_logits.argmax(-1) == loop_logits.argmax(-1)).float().mean()))
