"""``python -m anyspeed <command>`` and ``torchrun -m anyspeed pretrain ...``."""

from anyspeed.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
