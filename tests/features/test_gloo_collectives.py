"""gloo-collectives: the distributed optimizer's reduce-scatter / all-gather as all-reduces.

Checked against torch's own gloo collectives on 3 ranks (so the shard offsets are not trivial),
sync and async, fp32 and bf16; calls on any other layout must go to torch unchanged. The
end-to-end effect (DP2 + distributed optimizer equal to one process) is in test_pretrain.py,
which runs at the default level with this rewrite on.
"""

from __future__ import annotations

import pytest

from anyspeed.testing import run_distributed
from helpers import feature_ranks


@pytest.mark.parametrize("async_op", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_rewrites_equal_torch_collectives(async_op):
    for res in run_distributed(feature_ranks.gloo_collectives, 3, async_op=async_op, timeout=120):
        fell_back = res.pop("fell_back")
        assert all(res.values()), res
        assert fell_back == ["rs", "ag"]  # only the non-shard calls


def test_flat_output_all_gather_like_nccl():
    """gloo refuses an all-gather into a flat output of a shaped input; NCCL (and now the
    one line) writes the ranks' elements one after the other."""
    want = [float(x) for x in range(8)] + [float(x + 100) for x in range(8)]
    assert run_distributed(feature_ranks.gather_split_1d, 2, timeout=120) == [want, want]


def test_groups_megatron_forgets_are_destroyed():
    """Each gloo group keeps threads busy; parallel state set up again and again (Megatron's
    tests) piled up thousands. Under the Megatron test plugin's cleanup, nothing of
    destroy_model_parallel's groups is left."""
    for r in run_distributed(feature_ranks.groups_after_destroy, 2, timeout=120):
        assert r["held"] > 5 and r["left"] == [0, 0, 0] and r["sums"] == [2.0, 2.0, 2.0]
