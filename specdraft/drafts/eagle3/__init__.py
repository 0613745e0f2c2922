"""EAGLE-3 (and 3.1): the model (model.py); its layer, drafter and speculators / SGLang files are the
shared blocks drafts/eagle3_layer.py, eagle3_decode.py and eagle3_export.py (P-EAGLE builds on them)."""
