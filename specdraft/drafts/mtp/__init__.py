"""MTP: fine-tuning a target's own native multi-token-prediction layer (Qwen3-Next): the model
(model.py, the layer in layer.py), its training (train.py), drafter (decode.py) and files
(export.py)."""
