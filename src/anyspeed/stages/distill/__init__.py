"""``--stage distill``: on-policy distillation of a student toward a frozen teacher."""
