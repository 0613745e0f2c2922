"""Parallelism below the families and the target: sequence parallelism (sequence.py)."""
