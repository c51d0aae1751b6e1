"""Level-1 kernels: ``feature`` wires them into Megatron's seams; one module per operator."""
