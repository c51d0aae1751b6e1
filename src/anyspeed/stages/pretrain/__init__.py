"""``anyspeed pretrain``: next-token prediction on Megatron's GPT datasets."""
