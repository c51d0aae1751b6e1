"""The test harness says where a rank that crashed (SIGSEGV) died: a peer's 'connection closed'
error alone does not, which left a crash in CI without a stack."""

from __future__ import annotations

import pytest

from anyspeed.testing import DistributedError, run_distributed
from helpers import harness_ranks


@pytest.mark.parametrize("fresh", [True, False])
def test_a_segfaulting_rank_reports_its_stack(fresh: bool) -> None:
    with pytest.raises(DistributedError) as err:
        run_distributed(harness_ranks.crash_in_named_frame, 2, victim=1, timeout=60, fresh=fresh)
    text = str(err.value)
    assert "rank 1 died of signal 11" in text
    assert "crash_in_named_frame" in text  # the dumped Python stack names the frame
