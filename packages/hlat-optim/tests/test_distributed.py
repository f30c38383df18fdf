"""clip_grad_norm_ and AdamW with real gloo process groups (2 spawned processes)."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hlat_optim import AdamW

WORLD = 2


def globals_(seed, *shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = Path(__file__).with_name("dist_worker.py")
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(r), str(WORLD), str(port), str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORLD)
    ]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


pytestmark = pytest.mark.slow


def test_plain_sharded_gradients_sum_over_the_group_and_replicated_ones_count_once(ranks):
    expected = torch.linalg.vector_norm(torch.cat([globals_(0, 10 * WORLD), globals_(7, 4)]))
    for r in ranks:
        torch.testing.assert_close(r["group_norm"], expected)


def test_pipeline_stage_norms_add_up_over_the_stage_group(ranks):
    expected = torch.linalg.vector_norm(torch.cat([globals_(20 + i, 5) for i in range(WORLD)]))
    for r in ranks:
        torch.testing.assert_close(r["stage_norm"], expected)


def test_dtensor_norm_covers_shards_once_and_replicas_once(ranks):
    g1, g2 = globals_(1, 8, 4), globals_(2, 3)
    expected = torch.sqrt(g1.square().sum() + g2.square().sum())
    for r in ranks:
        torch.testing.assert_close(r["dtensor_norm"], expected)
        torch.testing.assert_close(r["dtensor_clipped"], g1 / (expected + 1e-6))


def _single_process(seed, i):
    p = torch.nn.Parameter(globals_(seed, 8, 6).bfloat16())
    # Parameter index i keeps the key schedule of the three-parameter distributed run.
    others = [torch.nn.Parameter(torch.zeros(1)) for _ in range(3)]
    others[i] = p
    opt = AdamW(others, lr=1e-2, weight_decay=0.1, impl="reference")
    for step in range(3):
        p.grad = globals_(100 + 10 * step + i, 8, 6).bfloat16()
        opt.step()
    return p.detach()


def test_dim0_sharded_dtensor_update_is_bit_identical_to_the_unsharded_one(ranks):
    expected = _single_process(3, 0)
    for r in ranks:
        assert torch.equal(r["shard0"].view(torch.int16), expected.view(torch.int16))


def test_a_gradient_in_another_layout_than_its_parameter_gives_the_same_update(ranks):
    # A one-parameter optimizer has parameter index 0, like the first of _single_process's
    # three, so the rounding keys match.
    expected = _single_process(3, 0)
    for r in ranks:
        for key in ("shard0_replicated_grad", "shard0_replicated_grad_compiled"):
            assert torch.equal(r[key].view(torch.int16), expected.view(torch.int16)), key


def test_a_resumed_compiled_run_with_partial_gradients_and_clip_coef_is_bit_exact(ranks):
    # the steady and the full compiled step multiply a gradient by the coefficient at the
    # same point: after it is brought to its parameter's layout
    for r in ranks:
        expected = r["partial_clipped"].view(torch.int16)
        assert torch.equal(r["partial_clipped_resumed"].view(torch.int16), expected)


def test_replicated_dtensor_stays_identical_on_every_rank(ranks):
    expected = _single_process(5, 2)
    for r in ranks:
        assert torch.equal(r["replicate"].view(torch.int16), expected.view(torch.int16))


def test_dim1_shards_draw_different_rounding_streams(ranks):
    # The worker gives both dim-1 shards identical values and gradients, so identical local
    # results would mean both ranks used one random stream.
    local0, local1 = ranks[0]["shard1_local"], ranks[1]["shard1_local"]
    assert not torch.equal(local0, local1)
    torch.testing.assert_close(local0.float(), local1.float(), atol=0, rtol=3 * 2**-7)


def test_stochastic_round_of_a_dtensor_rounds_each_shard_and_keeps_placements(ranks):
    for r in ranks:
        assert r["sr_placements"] == ["Shard(dim=0)"]
        assert r["sr_local"].dtype == torch.bfloat16
        assert torch.equal(r["sr_local"], r["sr_expected_local"])


def test_the_compiled_flat_update_of_dtensor_shards_equals_the_reference(ranks):
    for r in ranks:
        storages = set()
        for name in ("shard0", "shard1", "replicate"):
            assert torch.equal(
                r[name + "_local_compiled"].view(torch.int16),
                r[name + "_local"].view(torch.int16),
            )
            placements, local, storage = r[name + "_state_compiled"]
            reference_placements, reference_local, _ = r[name + "_state"]
            # the state keeps its DTensor layout, over a view of the optimizer's flat buffer
            assert placements == reference_placements
            assert torch.equal(local.view(torch.int16), reference_local.view(torch.int16))
            storages.add(storage)
        assert len(storages) == 1  # the three states share one buffer
