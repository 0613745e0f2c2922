"""Draft files: our self-describing export (files.py) and reading other tools' files for
`draft.init_from` (init_from.py)."""
