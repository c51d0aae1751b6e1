"""Megatron-LM's own ``pretrain_gpt.py``, run as it is and without anyspeed, for the reference
row of ``benchmarks/gpu.py``.

Two steps are left out, each only where it cannot change the run and could stop it on a
machine lent to run models: rebuilding Megatron's dataset index helpers (``compile_helpers``:
make, a C++ compiler, pybind11 and Python's headers) when a compiled copy already imports
(``scripts/device.sh prepare`` puts the megatron-core wheel's copy beside the sources); and
``fused_kernels.load``, which at core_v0.16.1 builds nothing and only reads nvcc's version,
when torch finds no CUDA toolkit to read it from.

    python -m torch.distributed.run --nproc-per-node 1 benchmarks/megatron_pretrain.py \\
        <Megatron-LM>/pretrain_gpt.py [its flags]
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: megatron_pretrain.py <Megatron-LM>/pretrain_gpt.py [flags]")
    script = os.path.abspath(sys.argv[1])
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        pass  # Megatron builds the helpers itself, as usual
    else:
        import megatron.core.datasets.utils as utils

        utils.compile_helpers = lambda: None
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        try:
            import megatron.legacy.fused_kernels as fused_kernels
        except ImportError:  # megatron-core alone: Megatron-LM's training code is not here
            pass
        else:
            fused_kernels.load = lambda args: None
    sys.argv = [script, *sys.argv[2:]]
    sys.path.insert(0, os.path.dirname(script))  # as `python pretrain_gpt.py` would
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
