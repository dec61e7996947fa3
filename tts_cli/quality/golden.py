"""Our model against golden records of the official implementation (tools/make_golden.py).

Each check compares one quantity with a stated threshold: relative L2 error for embeddings,
logits, hidden states and waveforms (fp32), exact equality for token ids and greedy codes. Beside
the records: the streamed codec against its full decode, and seeded sampling run twice. The same
checks serve the tests and `tts verify-golden`. The thresholds hold for fp32 only; bf16 needs its
own (the engine issue defines them).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tts_cli.model.generate import RowInput, generate
from tts_cli.model.prompt import assistant_text, prompt_embeddings
from tts_cli.request import Request
from tts_cli.synthesizer import Synthesizer, code_predictor_settings, talker_settings

REL_L2_MAX = 1e-4
STREAM_REL_L2_MAX = 1e-5   # streamed vs full codec decode, same model: only summation order differs
STREAM_CHUNKS = (1, 2, 3, 5, 8, 13)  # frames per decode step, cycled: covers 1-frame and multi-frame steps


@dataclass
class Check:
    name: str
    value: float | None   # relative L2 error, or 0/1 mismatch for exact checks; None: not available
    threshold: float
    exact: bool = False
    note: str = ""        # why a check is not available

    @property
    def passed(self) -> bool:
        if self.value is None:
            return False
        return self.value == 0 if self.exact else self.value <= self.threshold

    @property
    def failed(self) -> bool:
        """Available and outside its threshold (a check that is not available neither passes nor fails)."""
        return self.value is not None and not self.passed


def rel_l2(ours: torch.Tensor, ref: torch.Tensor) -> float:
    if ours.shape != ref.shape:
        return float("inf")
    ours, ref = ours.detach().cpu().double(), ref.detach().cpu().double()
    return float((ours - ref).norm() / ref.norm().clamp_min(1e-30))


def load_records(golden_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file
    golden_dir = Path(golden_dir)
    meta = json.loads((golden_dir / "records.json").read_text(encoding="utf-8"))
    return load_file(str(golden_dir / "records.safetensors")), meta


def _exact(name: str, equal: bool) -> Check:
    return Check(name, 0.0 if equal else 1.0, 0.0, exact=True)


def prompt_requests(meta: dict) -> list[Request]:
    return [Request(id=f"p{p['index']}", text=p["text"], speaker=p["speaker"], language=p["language"],
                    instruct=p["instruct"], seed=0) for p in meta["prompts"]]


def compare(synth: Synthesizer, records: dict[str, torch.Tensor], meta: dict) -> list[Check]:
    """All checks of one golden record set; the synthesizer must run in fp32 for the thresholds."""
    device = next(synth.model.parameters()).device
    records = {name: tensor.to(device) for name, tensor in records.items()}
    greedy = synth.ckpt.sampling.greedy()
    talker_s, cp_s = talker_settings(greedy), code_predictor_settings(greedy)
    checks: list[Check] = []
    requests = prompt_requests(meta)
    for i, request in enumerate(requests):
        p = f"p{i}"
        ref_codes = records[f"{p}.greedy_codes"]
        frames = ref_codes.shape[0]
        checks.append(_exact(f"{p} text token ids",
                             synth.tokenize(assistant_text(request.text)) == records[f"{p}.input_ids"].tolist()))
        embeds = prompt_embeddings(synth.model.talker, synth.prompt(request))
        checks.append(Check(f"{p} prompt embeddings", rel_l2(embeds, records[f"{p}.prefill_embeds"]), REL_L2_MAX))

        # Teacher-forced: feed the official codes, compare every logit along the way.
        forced = generate(synth.model, [RowInput(embeds, 0, frames, teacher_codes=ref_codes)], talker_s, cp_s,
                          min_new_tokens=frames + 1, trace=True)[0]
        checks.append(Check(f"{p} talker logits (teacher-forced, {frames + 1} steps)",
                            rel_l2(torch.stack(forced.talker_logits), records[f"{p}.talker_logits"]), REL_L2_MAX))
        checks.append(Check(f"{p} talker hidden states",
                            rel_l2(torch.stack(forced.past_hidden), records[f"{p}.past_hidden"]), REL_L2_MAX))
        ref_cp = records[f"{p}.cp_logits"]
        checks.append(Check(f"{p} code-predictor logits (teacher-forced, {ref_cp.shape[0]} frames)",
                            rel_l2(torch.stack(forced.cp_logits[:ref_cp.shape[0]]), ref_cp), REL_L2_MAX))

        # Free-running greedy, length forced as in the records, then the official EOS rule.
        free = generate(synth.model, [RowInput(embeds, 0, frames)], talker_s, cp_s, min_new_tokens=frames + 1)[0]
        checks.append(_exact(f"{p} greedy codes ({frames} frames x 16)", torch.equal(free.codes, ref_codes)))
        natural_ref = records[f"{p}.greedy_codes_natural"]
        natural_cap = meta["prompts"][i]["natural_max_new_tokens"] - 1
        natural = generate(synth.model, [RowInput(embeds, 0, natural_cap)], talker_s, cp_s)[0]
        stop = "EOS" if natural_ref.shape[0] < natural_cap else "cap"
        checks.append(_exact(f"{p} greedy codes, official EOS rule ({natural_ref.shape[0]} frames, {stop})",
                             torch.equal(natural.codes, natural_ref)))
        wav = torch.from_numpy(synth.decode([ref_codes])[0])
        checks.append(Check(f"{p} waveform", rel_l2(wav, records[f"{p}.wav"]), REL_L2_MAX))

    batch = synth.synthesize(requests, greedy=True, max_frames=frames, min_new_tokens=frames + 1)
    checks.append(_exact(f"batch of {len(requests)}: greedy codes",
                         all(torch.equal(r.codes, records[f"batch.greedy_codes.{i}"]) for i, r in enumerate(batch))))
    codec_wav = torch.from_numpy(synth.decode([records["codec.codes"]])[0])
    checks.append(Check(f"codec waveform ({records['codec.codes'].shape[0]} frames)",
                        rel_l2(codec_wav, records["codec.wav"]), REL_L2_MAX))
    checks.append(streamed_codec_check(synth, records["codec.codes"]))
    checks.append(seeded_determinism_check(synth, requests, frames))
    checks.append(Check("depth kernel vs loop codes", None, 0.0, exact=True,
                        note="not available: no depth kernel in this build (engine issue)"))
    return checks


def streamed_codec_check(synth: Synthesizer, codes: torch.Tensor) -> Check:
    """The codec fed a few frames at a time (per-row state) against one full decode of the same codes."""
    codes = codes.unsqueeze(0)
    with torch.no_grad():
        full = synth.codec.decode(codes)
        state, pieces, start, step = synth.codec.new_state(1), [], 0, 0
        while start < codes.shape[1]:
            size = STREAM_CHUNKS[step % len(STREAM_CHUNKS)]
            pieces.append(synth.codec.decode_step(codes[:, start:start + size], state))
            start, step = start + size, step + 1
    return Check(f"codec streamed in chunks of {'/'.join(map(str, STREAM_CHUNKS))} frames vs full decode",
                 rel_l2(torch.cat(pieces, dim=1), full), STREAM_REL_L2_MAX)


def seeded_determinism_check(synth: Synthesizer, requests: list[Request], frames: int) -> Check:
    """Sampled (not greedy) synthesis of the prompts, seeded, twice: the codes must be equal."""
    seeded = [replace(request, seed=1000 + i) for i, request in enumerate(requests)]
    runs = [synth.synthesize(seeded, greedy=False, max_frames=frames, min_new_tokens=frames + 1) for _ in range(2)]
    return _exact(f"seeded sampling, {len(seeded)} rows x {frames} frames, two runs",
                  all(torch.equal(a.codes, b.codes) for a, b in zip(*runs)))
