"""DFlash2: DFlash's block backbone with a local convolution around every sublayer (conv.py) and a
candidate selector reranking each slot's top-K (selector.py): its keys (options.py), the model
(model.py), its training (train.py), drafter (decode.py) and speculators files (export.py)."""
