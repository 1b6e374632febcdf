"""Measurements outside the harness that a current result still cites: ``answer_levers`` (the
accuracy result's ``attached`` levers) and ``pin_rate`` (the GPU host's ``pin`` job). A probe whose
question is settled leaves the tree; git history keeps it."""
