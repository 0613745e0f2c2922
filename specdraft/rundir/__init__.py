"""A run directory and the other places specdraft writes: their layout (layout.py), what counts as
ours and what is refused (ownership.py), and writes that land whole or not at all (atomic.py)."""
