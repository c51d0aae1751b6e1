"""Checkpoints in one place: layout on disk, restricted reads, checks, the model record, save/load.

* :mod:`.files` -- Megatron's directory convention (tracker, ``iter_*``/``release``, legacy
  ``mp_rank_*`` names) and the cleanup of what killed runs left; standard library only, so the
  lowest layers use it too.
* :mod:`.reads` -- where the checkpoint under a path is, its format, its common state,
  ``.metadata`` and RNG files, read through :mod:`anyspeed.safe_pickle` (tensors mapped by
  :mod:`.torch_files` over :mod:`.file_maps`).
* :mod:`.checks` -- the pre-start checks of a ``--load`` (files whole, shapes fit the model)
  and one line naming the file when a load or save fails anyway.
* :mod:`.record` -- the one model record (``anyspeed_model``) every writer stores and every
  reader (convert, generate/evaluate, LoRA merge) takes the architecture from
  (Megatron-LM's ``args``: :mod:`.megatron_lm_args`).
* :mod:`.save` / :mod:`.load` -- atomic training saves, and loads at any layout (what both
  share: :mod:`.state`; :mod:`.rng`, :mod:`.optimizer_groups`), and :func:`.load.load_weights`
  for inference.

Nothing is imported here: ``anyspeed.checkpoint.files`` stays a standard-library import.
"""
