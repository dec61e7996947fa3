"""tts_cli.model.talker.TextProjection: the fp32 product over the values of narrower weights,
which it widens once rather than for every prompt."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tts_cli.model.talker import TextProjection


def widened_per_call(proj: TextProjection, x: torch.Tensor) -> torch.Tensor:
    """What Linear.reference computes, widening each weight for the call."""
    fc1, fc2 = proj.linear_fc1, proj.linear_fc2
    return F.linear(F.silu(F.linear(x, fc1.weight.float(), fc1.bias.float())), fc2.weight.float(), fc2.bias.float())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_text_projection_is_the_fp32_product_of_its_weights_values(dtype):
    torch.manual_seed(0)
    proj = TextProjection(64, 48).to(dtype).requires_grad_(False)
    x = torch.randn(5, 64)
    out = proj(x)
    assert out.dtype == torch.float32
    assert torch.equal(out, widened_per_call(proj, x))
    assert torch.equal(proj(x), out)
    assert proj._parameters_as(torch.float32)[0] is proj._parameters_as(torch.float32)[0]   # widened once


def test_text_projection_follows_a_weight_changed_in_place_or_replaced():
    torch.manual_seed(0)
    proj = TextProjection(64, 48).half().requires_grad_(False)
    x = torch.randn(5, 64)
    before = proj(x)
    with torch.no_grad():
        proj.linear_fc1.weight.mul_(2)
    changed = proj(x)
    assert not torch.equal(changed, before)
    assert torch.equal(changed, widened_per_call(proj, x))
    proj.linear_fc2.bias = nn.Parameter(torch.ones(48, dtype=torch.float16), requires_grad=False)
    assert torch.equal(proj(x), widened_per_call(proj, x))
