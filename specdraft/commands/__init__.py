"""The commands besides training, one module each, built on the packages below (cli.py dispatches)."""
