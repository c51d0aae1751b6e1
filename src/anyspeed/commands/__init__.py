"""The ``anyspeed`` commands (``cli.py`` dispatches to them): ``preprocess`` and
``train-tokenizer``, ``convert``, ``memory``, ``generate`` (with its chat) and ``evaluate``;
each parses its flags and calls the library below."""
