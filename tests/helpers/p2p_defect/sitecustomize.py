"""A deliberate pipeline defect for ``anyspeed verify``'s test (on PYTHONPATH only there):
with ANYSPEED_TEST_P2P_DEFECT set, every activation a pipeline stage receives has its first
two samples swapped, as a p2p that delivers messages out of order would."""

import os

if os.environ.get("ANYSPEED_TEST_P2P_DEFECT"):
    from megatron.core.pipeline_parallel import p2p_communication as _p2p

    _original = _p2p.P2PCommunicator._communicate

    def _swapped(self, *args, **kwargs):
        prev, nxt, reqs = _original(self, *args, **kwargs)
        if prev is not None and prev.dim() == 3 and prev.shape[1] > 1:
            order = [1, 0, *range(2, prev.shape[1])]
            prev.data.copy_(prev.data[:, order].clone())
        return prev, nxt, reqs

    _p2p.P2PCommunicator._communicate = _swapped
