"""GLIDE: the model (model.py), its training (train.py), drafter (decode.py) and LongSpec's files
(export.py)."""
