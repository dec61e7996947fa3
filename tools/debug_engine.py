"""Runs the engine eagerly (no CUDA graphs) on random:1.7b with slot refill, to localize faults."""
import sys
import traceback

import torch

from tts_cli.bench import SENTENCES, load_synthesizer, make_requests
from tts_cli.engine.runner import Engine
from tts_cli.synthesizer import code_predictor_settings, talker_settings

rows, count, graphs = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "graphs"
synth = load_synthesizer("random:1.7b", "cuda", torch.bfloat16)
requests = make_requests(synth, SENTENCES.read_text().splitlines(), count, None, "vivian")
context = max(r.prompt_embeds.shape[0] + r.max_frames + 1 for r in requests)
print("context", context, "frames", [r.max_frames for r in requests][:10], flush=True)
engine = Engine(synth.model, synth.codec, rows=rows, context=64 * -(-context // 64),
                talker_defaults=talker_settings(synth.ckpt.sampling),
                cp_defaults=code_predictor_settings(synth.ckpt.sampling), use_graphs=graphs)
step = engine.step
original_depth = step._depth


def checked_depth():
    st = step.st
    bad = (st.active & (st.g0 != step.eos) & (st.frame < st.cap) & (st.g0 >= 2048)).nonzero().flatten().tolist()
    if bad:
        print("step", engine.stats.steps, "bad slots", bad, "g0", st.g0[bad].tolist(), "frame", st.frame[bad].tolist(),
              "cap", st.cap[bad].tolist(), "position", st.position[bad].tolist(), flush=True)
        raise SystemExit(1)
    original_depth()


original_talker = step._talker


def checked_talker():
    st = step.st
    import tts_cli.model.sampler as sampler
    captured = {}
    real_choose = sampler.choose

    def spy(logits, rows, seeds, frame, group, top_p=True):
        out = real_choose(logits, rows, seeds, frame, group, top_p)
        captured.update(logits=logits.clone(), out=out.clone())
        return out

    import tts_cli.engine.step as step_module
    step_module.choose = spy
    try:
        original_talker()
    finally:
        step_module.choose = real_choose
    out, logits = captured["out"], captured["logits"]
    bad = ((out >= 2048) & (out != step.eos)).nonzero().flatten().tolist()
    if bad:
        b = bad[0]
        row = logits[b]
        print("talker drew", out[bad].tolist(), "for slots", bad, "emit", step.emit[bad].tolist(),
              "finite", int(torch.isfinite(row).sum()), "nan", int(torch.isnan(row).sum()),
              "value at draw", float(row[out[b]]), "top_k", st.talker_sampling.top_k[b].item(),
              "temp", st.talker_sampling.temperature[b].item(), "do_sample", st.talker_sampling.do_sample[b].item(),
              flush=True)
        raise SystemExit(1)


if not graphs:
    step.stage_fns["depth"] = checked_depth
    step.stage_fns["talker"] = checked_talker
try:
    results = engine.run(requests)
    print("ok", sum(len(r.codes) for r in results), flush=True)
except Exception:
    traceback.print_exc()
    print("positions", engine.state.position.tolist(), "frames", engine.state.frame.tolist(),
          "active", engine.state.active.tolist())
