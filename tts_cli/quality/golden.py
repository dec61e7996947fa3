"""Our model against golden records of the official implementation (tools/make_golden.py).

Each check compares one quantity with a stated threshold: relative L2 error for embeddings,
logits, hidden states and waveforms (fp32), exact equality for token ids and greedy codes.
The same checks serve the tests and (later) `tts verify-golden`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tts_cli.model.generate import RowInput, generate
from tts_cli.model.prompt import assistant_text, prompt_embeddings
from tts_cli.request import Request
from tts_cli.synthesizer import Synthesizer, code_predictor_settings, talker_settings

REL_L2_MAX = 1e-4


@dataclass
class Check:
    name: str
    value: float          # relative L2 error, or 0/1 mismatch for exact checks
    threshold: float
    exact: bool = False

    @property
    def passed(self) -> bool:
        return self.value == 0 if self.exact else self.value <= self.threshold


def rel_l2(ours: torch.Tensor, ref: torch.Tensor) -> float:
    if ours.shape != ref.shape:
        return float("inf")
    return float((ours.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


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
    return checks
