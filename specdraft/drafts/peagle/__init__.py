"""P-EAGLE: the EAGLE-3 layer proposing K tokens per forward (model.py), its COD sampling (cod.py),
its drafter (decode.py) and speculators files (export.py)."""
