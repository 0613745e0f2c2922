"""EAGLE-3 (and 3.1): the model (model.py) over its layer (layer.py: the fused target states, one
decoder layer, the draft-vocab head), its training-time-test attention (ttt_attention.py), its
draft vocabulary (vocab.py), training (train.py), drafter (decode.py) and speculators / SGLang
files (export.py). P-EAGLE builds on the layer."""
