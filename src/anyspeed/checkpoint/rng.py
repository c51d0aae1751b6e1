"""Each rank's random generators, saved beside a checkpoint and restored on resume.

One file per rank (``anyspeed_rng/<rank_key>.pt``): the torch, device, numpy and Python
generators and Megatron's model-parallel RNG tracker, so a resumed run draws what an unbroken
one would have.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict[str, torch.Tensor]:
    """This rank's generators: torch (and the device's), numpy, Python, Megatron's tracker."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from anyspeed.device import detect

    info = detect()
    out: dict[str, torch.Tensor] = {"torch": torch.get_rng_state()}
    if not info.is_cpu:
        out["device"] = getattr(torch, info.type).get_rng_state()
    np_state = np.random.get_state()
    out["numpy_keys"] = torch.from_numpy(np.asarray(np_state[1], dtype=np.int64))
    out["numpy_pos"] = torch.tensor([np_state[2], np_state[3]], dtype=torch.float64)
    py = random.getstate()
    out["python"] = torch.tensor(list(py[1]), dtype=torch.int64)
    for name, st in get_cuda_rng_tracker().get_states().items():
        out[f"tracker.{name}"] = st
    return out


def set_rng_state(st: dict[str, torch.Tensor]) -> None:
    """Restore what :func:`rng_state` saved (the device's only on that kind of device)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from anyspeed.device import detect

    info = detect()
    torch.set_rng_state(st["torch"])
    if "device" in st and not info.is_cpu:
        getattr(torch, info.type).set_rng_state(st["device"])
    pos = st["numpy_pos"].tolist()
    np.random.set_state(
        ("MT19937", st["numpy_keys"].numpy().astype(np.uint32), int(pos[0]), 0, pos[1])
    )
    random.setstate((3, tuple(int(x) for x in st["python"].tolist()), None))
    tracker = {k.split(".", 1)[1]: v for k, v in st.items() if k.startswith("tracker.")}
    if tracker:
        get_cuda_rng_tracker().set_states(tracker)


def rank_key() -> str:
    """This rank's RNG file name: ``pp0_tp1_cp0_dp0`` (RNG state restores only at one layout)."""
    from megatron.core import parallel_state as ps

    return (
        f"pp{ps.get_pipeline_model_parallel_rank()}_tp{ps.get_tensor_model_parallel_rank()}"
        f"_cp{ps.get_context_parallel_rank()}_dp{ps.get_data_parallel_rank()}"
    )
