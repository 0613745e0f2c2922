"""DFlash: its keys (options.py), the block backbone and the family (model.py: the layers in
layer.py, the block layout and visibility in blocks.py), its training (train.py), drafter
(decode.py) and speculators files (export.py). DSpark builds on the backbone."""
