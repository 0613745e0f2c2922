"""Checkpoints of a training run: the policy (manager.py) over slots that commit last and verify
before anything is loaded (slots.py), each draft's part (draft_parts.py), the state DeepSpeed does
not save (untrained_state.py), other world sizes and ZeRO stages (universal.py), RNG state (rng.py)."""
