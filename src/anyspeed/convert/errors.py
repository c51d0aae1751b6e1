"""The converter's error: one line, raised before anything is written under the final name."""

from anyspeed.errors import UsageError


class ConvertError(UsageError):
    """Bad input to ``anyspeed convert`` (the message is one line naming what to fix)."""
