"""``anyspeed verify``: a user's own training command at its layout against a reference
layout, step by step, from the same weights and batches (:mod:`anyspeed.commands.verify`)."""
