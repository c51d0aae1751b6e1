"""What two or more stages share, public: instruction and GPT data, the frozen reference, LoRA's
start and loss reductions (every stage's flag ranges: :mod:`anyspeed.stages.ranges`). A stage
imports these and ``training/``, never a sibling stage."""
