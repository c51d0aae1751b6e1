"""Qwen2-VL / Qwen2.5-VL pieces on Megatron-Core: the 3-D (mRoPE) positions of a sequence with
images and videos (:mod:`.positions`)."""
