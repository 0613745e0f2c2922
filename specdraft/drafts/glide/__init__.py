"""GLIDE: the model (model.py), its drafter (decode.py) and LongSpec's files (longspec.py)."""
