"""Bit-for-bit comparison of optimizer runs, shared by the tests of the grouped and the
steady steps."""

import torch


def bits(t):
    """A tensor's bit pattern (int16 for bf16, int32 for fp32), copied."""
    t = t.detach()
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).clone()


def snapshot(opt, params):
    """Bit patterns of every parameter and state tensor, step counts included."""
    return [bits(t) for p in params for t in [p, *opt.state[p].values()]]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
