"""``--stage vlm``: a LLaVA vision-language model on image-text conversations."""
