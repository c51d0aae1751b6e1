"""The one line for users' scripts: ``import anyspeed.megatron_adaptor`` after ``import torch``.

Importing it applies anyspeed from this process's command line (``sys.argv``): see
:mod:`anyspeed.adaptor`, which anyspeed's own modules use instead (they never import this shim).
A bad request stops the process with a one-line error before any process group exists.
"""

import sys

from anyspeed.adaptor import AdaptorState, FeatureError, apply, apply_command_line, state, undo

__all__ = ["AdaptorState", "FeatureError", "apply", "state", "undo"]

apply_command_line(sys.argv[1:])
