"""Commands that use a trained or converted model: ``anyspeed generate`` and ``evaluate``."""
