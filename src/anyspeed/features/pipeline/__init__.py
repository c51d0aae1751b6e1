"""Pipeline schedules beyond Megatron-Core's own: DualPipeV (``--schedules-method``)."""
