"""DualPipeV (``--schedules-method dualpipev``): the plan of each rank's work, the links its
messages take, and the schedule that runs Megatron's forward and backward steps in that order."""
