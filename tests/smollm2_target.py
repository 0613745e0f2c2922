"""The suite's real-model target: the smollm2 preset keeping its first 4 layers (of 30). Fewer
would be faster, but EAGLE-3, P-EAGLE, DFlash and DSpark read three layers, and the ones every
server captures are the inputs of layers 1..L-1 (a 2-layer target's defaults export natively only)."""

import dataclasses

from specdraft.demo.presets import PRESETS

SMOLLM2_TEST = dataclasses.replace(PRESETS["smollm2"], name="smollm2-4l", num_hidden_layers=4)
IM_END = 2  # <|im_end|>: pad, eos and end of turn at once
SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # the template's default
