"""DSpark: DFlash's block backbone plus its heads (model.py), its training (train.py: DFlash's
loss plus the confidence head's), drafter (decode.py) and speculators files (export.py)."""
