"""specdraft: train draft models for speculative decoding against a frozen target LLM."""

__version__ = "0.1.0"
