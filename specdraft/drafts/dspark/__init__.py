"""DSpark: the model (model.py: DFlash's block backbone plus its heads), its drafter (decode.py), its
speculators files (speculators.py)."""
