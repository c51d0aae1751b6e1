"""FP8 training without Transformer Engine (Megatron's ``--fp8-*`` flags): see :mod:`.feature`."""
