"""DFlash: the family (model.py) over its block backbone (backbone.py: the layers, options.py: its
keys and shapes, blocks.py: the block layout and visibility, dpace.py: D-PACE's weights), its
drafter (decode.py) and speculators files (speculators.py). DSpark builds on the backbone."""
