"""``--stage sft``: supervised fine-tuning (full or LoRA) on instruction data."""
