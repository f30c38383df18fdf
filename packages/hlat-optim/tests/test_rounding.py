import math

import pytest
import torch

from hlat_optim import stochastic_round, stochastic_round_
from hlat_optim.rounding import hashed_bits, round_with_bits

BF16_MAX = torch.finfo(torch.bfloat16).max
FP32_MAX = torch.finfo(torch.float32).max


def _neighbours(x: float) -> tuple[float, float]:
    t = torch.tensor([x], dtype=torch.float32)
    down = (t.view(torch.int32) & -(1 << 16)).view(torch.float32)
    up = ((t.view(torch.int32) & -(1 << 16)) + (1 << 16)).view(torch.float32)
    return down.item(), up.item()


def test_values_representable_in_bf16_round_exactly():
    x = torch.randn(10_000).bfloat16().float()
    x[:4] = torch.tensor([0.0, -0.0, 1e-40, -3.0])  # 1e-40 is subnormal, -0.0 keeps its sign
    x = x.bfloat16().float()
    out = stochastic_round(x, torch.Generator().manual_seed(0))
    assert torch.equal(out.view(torch.int16), x.bfloat16().view(torch.int16))


@pytest.mark.parametrize(
    "value",
    [
        1.0 + 2**-9,
        1.0 + 3 * 2**-10,
        -1.0 - 2**-9,
        3.14159,
        -2.71828e-3,
        6.02e23,
        -1.6e-19,
        1.7e-39,
        -2.3e-40,
    ],  # the last two are subnormal
)
def test_mean_of_many_roundings_equals_the_value(value):
    n = 200_000
    x = torch.full((n,), value, dtype=torch.float32)
    out = stochastic_round(x, torch.Generator().manual_seed(1)).double()
    down, up = _neighbours(value)
    assert set(out.unique().tolist()) <= {down, up}  # only the two neighbours occur
    p_up = (value - down) / (up - down)
    std_err = abs(up - down) * math.sqrt(p_up * (1 - p_up) / n)
    assert abs(out.mean().item() - value) < 5 * std_err


def test_special_values_are_preserved():
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), -float("nan"), 0.0, -0.0])
    out = stochastic_round(x.repeat(1000), torch.Generator().manual_seed(2)).view(1000, 6).T.float()
    assert (out[0] == float("inf")).all() and (out[1] == float("-inf")).all()
    assert out[2].isnan().all() and out[3].isnan().all()
    assert (out[4].view(torch.int32) == 0).all()
    assert (out[5].view(torch.int32) == torch.tensor(-0.0).view(torch.int32)).all()


def test_finite_values_above_the_bf16_maximum_saturate_instead_of_becoming_inf():
    x = torch.tensor([FP32_MAX, -FP32_MAX, BF16_MAX * 1.002, BF16_MAX]).repeat(1000)
    out = stochastic_round(x, torch.Generator().manual_seed(3)).float().view(1000, 4)
    assert out.isfinite().all()
    assert (out[:, 0] == BF16_MAX).all() and (out[:, 1] == -BF16_MAX).all()
    assert (out[:, 3] == BF16_MAX).all()


def test_values_near_the_bf16_maximum_round_between_their_neighbours():
    down, _ = _neighbours(BF16_MAX * 0.999)
    x = torch.full((10_000,), BF16_MAX * 0.999)
    out = stochastic_round(x, torch.Generator().manual_seed(4)).float()
    assert set(out.unique().tolist()) == {down, BF16_MAX}


def test_same_generator_seed_gives_the_same_rounding():
    x = torch.randn(4096)
    a = stochastic_round(x, torch.Generator().manual_seed(5))
    b = stochastic_round(x, torch.Generator().manual_seed(5))
    c = stochastic_round(x, torch.Generator().manual_seed(6))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_in_place_variant_writes_into_the_given_bf16_tensor():
    x = torch.randn(64, 32)
    out = torch.empty(64, 32, dtype=torch.bfloat16)
    returned = stochastic_round_(out, x, torch.Generator().manual_seed(7))
    assert returned is out
    assert torch.equal(out, stochastic_round(x, torch.Generator().manual_seed(7)))


def test_rejects_non_float32_input_with_a_clear_error():
    with pytest.raises(TypeError, match=r"float32 tensor, got torch\.float16"):
        stochastic_round(torch.ones(3, dtype=torch.float16))
    with pytest.raises(TypeError, match="bfloat16 tensor"):
        stochastic_round_(torch.empty(3), torch.ones(3))


def test_hashed_bits_give_unbiased_rounding():
    # The optimizer's rounding source: counter-based bits keyed per step.
    value = 1.0 + 2**-9  # a quarter of the way from 1.0 to the next bf16 (1 + 2**-7)
    n = 100_000
    x = torch.full((n,), value)
    means = []
    for key in range(5):
        bits = hashed_bits(torch.arange(n, dtype=torch.int32), torch.tensor(key, dtype=torch.int32))
        means.append(round_with_bits(x, bits & 0xFFFF).double().mean().item())
    std_err = 2**-7 * math.sqrt(0.25 * 0.75 / (5 * n))
    assert abs(sum(means) / 5 - value) < 5 * std_err
    assert len(set(means)) == 5  # different keys, different draws
