"""P-EAGLE: the EAGLE-3 layer proposing K tokens per forward (model.py), its COD sampling (cod.py)
and the slots' attention without their mask (cod_attention.py), its training (train.py), drafter
(decode.py) and speculators files (export.py)."""
