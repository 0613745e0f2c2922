"""EAGLE-3 (and 3.1): the model (model.py), its drafter (decode.py), its speculators and SGLang files
(export.py)."""
