"""MTP: fine-tuning a target's own native multi-token-prediction layer (Qwen3-Next)."""
