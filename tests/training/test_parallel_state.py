"""The second parallel state: :data:`STATE_GLOBALS` names every group global Megatron keeps (so
a Megatron upgrade that adds one fails here, not silently in a rollout), and a state built for
another layout is entered and left without disturbing the one in use."""

from __future__ import annotations

import re

from anyspeed.distributed.parallel_state import STATE_GLOBALS
from anyspeed.testing import run_distributed


def test_the_list_is_every_group_global_of_megatron():
    from megatron.core import parallel_state as ps

    found = {k for k in vars(ps) if re.fullmatch(r"_[A-Z][A-Z0-9_]*", k)}
    assert found == set(STATE_GLOBALS), found ^ set(STATE_GLOBALS)
    assert len(STATE_GLOBALS) == len(set(STATE_GLOBALS))


def _two_states() -> dict:
    from megatron.core import parallel_state as ps

    from anyspeed.distributed.groups import init_distributed
    from anyspeed.distributed.parallel_state import ParallelState
    from anyspeed.layout import Layout

    init_distributed(Layout(tp=2), seed=1)
    before = ParallelState.current().values
    other = ParallelState.build(1.0)  # TP 1, PP 1: every rank a replica
    assert ParallelState.current().values == before  # building left the state in use alone
    with other.entered():
        inside = (ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size())
    after = (ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size())
    return {"inside": inside, "after": after, "same": ParallelState.current().values == before}


def test_a_state_for_another_layout_is_entered_and_left():
    for res in run_distributed(_two_states, 2, timeout=120):
        assert res == {"inside": (1, 2), "after": (2, 1), "same": True}
