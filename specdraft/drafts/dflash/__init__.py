"""DFlash: the family (model.py) over the shared block backbone (drafts/dflash_backbone.py, its
blocks, drafter and speculators files beside it)."""
