"""The stages: the table ``anyspeed pretrain`` and ``anyspeed posttrain --stage S`` read, the path
from a command line to a checked :class:`~anyspeed.training.run.Run`, and one folder per stage
family (its flags, plan, task, data and loss). Shared pieces live in :mod:`.common`; a stage
imports ``training/`` and :mod:`.common`, never a sibling stage."""
