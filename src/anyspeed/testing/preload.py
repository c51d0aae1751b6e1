"""What the test ranks' fork server imports once (:mod:`anyspeed.testing.forkserver`).

Imports only: no adaptor is applied, no process group or device is touched, and Megatron-Core's
``jit_fuser`` is kept off first, as in a spawned rank. Import notices (no Apex, no Transformer
Engine) are not shown: each rank's own code decides what it prints.
"""

import warnings

from anyspeed.device.jit import keep_megatron_jit_off

keep_megatron_jit_off(unless_cuda=True)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    import anyspeed.adaptor  # noqa: F401
    import anyspeed.quiet  # noqa: F401
    import anyspeed.testing.pool  # noqa: F401
