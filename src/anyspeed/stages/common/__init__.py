"""What two or more stages share, public: instruction and GPT data, the frozen reference,
LoRA's start, loss reductions and flag-range checks. A stage imports these and ``training/``,
never a sibling stage."""
