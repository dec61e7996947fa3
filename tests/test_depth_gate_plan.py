"""The depth-frame gate's plan (kernels/tts_kernels/depth_gate_plan.py): its waits, its progress with
every CTA walking its list in order, and what its tasks compute: each task's work done in torch as the
Gluon kernel (tools/depth_gate_bench.py) does it, the logits compared with the real model's."""
import importlib.util
import os

import pytest
import torch

from tts_kernels import depth_gate_plan as P

TOOL = os.path.join(os.path.dirname(__file__), "..", "tools", "depth_gate_bench.py")


def bench_tool():
    pytest.importorskip("triton.experimental.gluon")
    spec = importlib.util.spec_from_file_location("depth_gate_bench", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("waits", ["grid", "fine"])
def test_plan_waits_are_met_and_all_ctas_finish(waits):
    plan = P.build(waits)
    assert len(plan.phases) == P.POSITIONS * P.LAYERS * 5 + (P.POSITIONS - 1) * 2 == 430
    P.check(plan, 132)
    P.check(P.handoff_only(plan), 132)


def test_check_refuses_a_wait_that_is_never_met():
    plan = P.build("grid", positions=2)
    plan.phases[3][0].fields[P.TARGET0] += 1
    with pytest.raises(AssertionError, match="target"):
        P.check(plan, 132)


def test_check_finds_a_deadlock():
    plan = P.build("grid", positions=2)
    lists, _ = P.per_cta(plan, 132)
    assert [t.phase for t in lists[0][:2]] == [0, 1]
    lists[0][:2] = lists[0][1::-1]   # CTA 0 would wait for phase 0 before doing its own task of it
    with pytest.raises(AssertionError, match="deadlock"):
        P.check(plan, 132, lists)


def emulate(plan, weights, params, f32, xt, emb, tool):
    """Each task's work, phase by phase, in torch, as the kernel does it (fp16 inputs, fp32 products)."""
    f = torch.float32
    cache = torch.zeros(2 * P.CACHE_SIZE, dtype=torch.float16)
    codes = torch.zeros(P.POSITIONS * P.ROWS, dtype=torch.int32)
    arrived = {}

    def tiles(first, n):
        return xt[first * P.ROWS:(first + n) * P.ROWS].reshape(n, P.ROWS, P.CHUNK_K).transpose(0, 1).reshape(P.ROWS, -1)

    def chunks(ids):
        return torch.cat([weights[c * P.CHUNK_ROWS:(c + 1) * P.CHUNK_ROWS] for c in ids], 1)

    def rinv(at, count):
        ss = f32[at:at + count * P.ROWS].view(count, P.ROWS).sum(0)
        return torch.rsqrt(ss / P.HIDDEN + tool.EPS.value)[:, None]

    rows = torch.arange(P.ROWS)
    for tasks in plan.phases:
        for t in tasks:
            k = t.fields
            kind, a, b, c, d = k[P.KIND], k[P.A], k[P.B], k[P.C], k[P.D]
            if kind in (P.QKVH, P.SWIGLU, P.PARTIAL):
                x = tiles(k[P.XTILE], k[P.NCHUNK]).to(f)
                if kind == P.SWIGLU:
                    gate, up = (x @ chunks(t.chunks[i::2]).to(f).t() * rinv(c, d) for i in (0, 1))
                    act = (gate / (1 + torch.exp(-gate)) * up).half()
                    xt[a * P.ROWS:(a + 1) * P.ROWS, b:b + P.CHUNK_ROWS] = act
                    continue
                acc = x @ chunks(t.chunks).to(f).t()
                if kind == P.QKVH:
                    f32[(a + rows[:, None] * b + torch.arange(P.CHUNK_ROWS)).flatten()] = (acc * rinv(c, d)).flatten()
                    continue
                at = (a + rows[:, None] * P.HIDDEN + torch.arange(P.CHUNK_ROWS)).flatten()
                f32[at] = acc.flatten()
                arrived[c] = arrived.get(c, 0) + 1
                if arrived[c] == P.SPLITS:
                    parts = torch.stack([f32[(k[P.E] + s * P.ROWS * P.HIDDEN + rows[:, None] * P.HIDDEN
                                              + torch.arange(P.CHUNK_ROWS)).flatten()] for s in range(P.SPLITS)])
                    hat = (rows[:, None] * P.HIDDEN + torch.arange(P.CHUNK_ROWS)).flatten()
                    h = (f32[k[P.H_IN] + hat] + parts.sum(0)).view(P.ROWS, P.CHUNK_ROWS)
                    f32[k[P.H_OUT] + hat] = h.flatten()
                    gain = params[k[P.GAIN]:k[P.GAIN] + P.CHUNK_ROWS]
                    tile, col = k[P.HN_TILE], k[P.HN_COL]
                    xt[tile * P.ROWS:(tile + 1) * P.ROWS, col:col + P.CHUNK_ROWS] = (h * gain).half()
                    f32[k[P.SS_OUT]:k[P.SS_OUT] + P.ROWS] = (h * h).sum(1)
            elif kind == P.ATTN:
                row0, pos, cache_at, tile, qnorm, cos_at = b, c, d, k[P.E], k[P.F], k[P.G]
                r = torch.arange(row0, row0 + P.ATTN_ROWS)
                block = f32[(a + r[:, None] * P.QKV + torch.arange(512)).flatten()].view(P.ATTN_ROWS, 4, P.HEAD_DIM)
                cos = params[cos_at:cos_at + P.HEAD_DIM]
                sin = params[cos_at + P.POSITIONS * P.HEAD_DIM:][:P.HEAD_DIM]

                def norm_rope(x, gain):
                    x = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + tool.EPS.value) * gain
                    return x * cos + torch.cat([-x[..., 64:], x[..., :64]], -1) * sin
                key = norm_rope(block[:, 2], params[qnorm + P.HEAD_DIM:][:P.HEAD_DIM]).half()
                stride = P.KV_HEADS * P.POSITIONS * P.HEAD_DIM
                at = (cache_at + r[:, None] * stride + pos * P.HEAD_DIM + torch.arange(P.HEAD_DIM)).flatten()
                cache[at], cache[P.CACHE_SIZE + at] = key.flatten(), block[:, 3].half().flatten()
                span = (cache_at + r[:, None, None] * stride + torch.arange(pos + 1)[None, :, None] * P.HEAD_DIM
                        + torch.arange(P.HEAD_DIM)).flatten()
                keys = cache[span].view(P.ATTN_ROWS, pos + 1, P.HEAD_DIM).to(f)
                values = cache[P.CACHE_SIZE + span].view(P.ATTN_ROWS, pos + 1, P.HEAD_DIM).to(f)
                for h in range(2):
                    q = norm_rope(block[:, h], params[qnorm:qnorm + P.HEAD_DIM]) / P.HEAD_DIM ** 0.5
                    w = torch.softmax(torch.einsum("rd,rjd->rj", q, keys), -1)
                    out = torch.einsum("rj,rjd->rd", w, values).half()
                    xt[tile * P.ROWS + r, h * P.HEAD_DIM:(h + 1) * P.HEAD_DIM] = out
            elif kind == P.DRAW:
                row, pos = b, c // P.ROWS
                logits = torch.zeros(P.POSITIONS, P.ROWS, P.VOCAB)
                logits[pos, row] = f32[a:a + P.VOCAB]
                code = int(tool.reference_draws(logits, lambda p: k[P.SEED], pos + 1)[pos, row])
                codes[c] = code
                if d >= 0:
                    e = emb[d + code * P.HIDDEN:][:P.HIDDEN].to(f)
                    f32[k[P.H_OUT]:k[P.H_OUT] + P.HIDDEN] = e
                    hn = (e * params[k[P.GAIN]:k[P.GAIN] + P.HIDDEN]).half()
                    for i in range(P.HIDDEN // P.CHUNK_K):
                        xt[(k[P.HN_TILE] + i) * P.ROWS + row] = hn[i * P.CHUNK_K:(i + 1) * P.CHUNK_K]
                    f32[k[P.SS_OUT]] = (e * e).sum()
    return codes.view(P.POSITIONS, P.ROWS)


def test_plan_computes_the_code_predictor():
    """Three positions (two given, one drawn): the emulated tasks' logits within 1% of the largest
    logit of the real model given the same codes, and the same draws from them."""
    tool = bench_tool()
    torch.manual_seed(0)
    positions = 3
    model = tool.random_model(torch.Generator().manual_seed(0), "cpu")
    plan = P.build("fine", positions=positions)
    P.check(plan, 132)
    weights, params, f32, xt = tool.device_buffers(model, plan.layout)
    codes = emulate(plan, weights, params, f32, xt, model["emb"].flatten(), tool)
    at = plan.layout.f32["logits"]
    logits = f32[at:at + positions * P.ROWS * P.VOCAB].view(positions, P.ROWS, P.VOCAB)
    reference = tool.reference_logits(model, codes, positions)[:positions]
    error = (logits[1:] - reference[1:]).abs().max() / reference[1:].abs().max()
    assert error < 0.01
    assert (logits[1:].argmax(-1) == reference[1:].argmax(-1)).float().mean() > 0.95
    padded = torch.zeros(P.POSITIONS, P.ROWS, P.VOCAB)
    padded[:positions] = logits
    assert torch.equal(tool.reference_draws(padded, lambda p: 1000 + p, positions)[1:positions], codes[1:positions].long())
