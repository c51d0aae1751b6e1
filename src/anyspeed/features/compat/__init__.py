"""Level-0 features: device compatibility, the layout check, accepted flags, Megatron-LM hooks.

One wiring module per concern (``device_compat``, ``cuda_only``, ``layout_check``,
``accepted_flags``, ``megatron_lm``) next to the algorithms they install (``pipeline_p2p``,
``torch_adam``, ``megatron_lm_steps``).
"""
