"""The vendor chat templates of tests/chat_templates/ on a copy of the tiny demo tokenizer, and what
each renders of an answer (the rules each file keeps, written out in Python to check against)."""

import shutil
from pathlib import Path

from transformers import AutoTokenizer

TEMPLATE_DIR = Path(__file__).resolve().parent / "chat_templates"
EOS = "<|eos|>"  # the tiny tokenizer's eos_token: what templates that say eos_token render

# name: (the template's special tokens added to the tokenizer, the end-of-turn after an answer)
TEMPLATES = {
    "qwen2_5": (["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    "qwen3": (["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    "phi4": (["<|im_start|>", "<|im_end|>", "<|im_sep|>"], "<|im_end|>"),
    "llama3_1": (["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
    "llama2": (["[INST]", "[/INST]"], " " + EOS),
    "mistral_v0_3": (
        [
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ],
        EOS,
    ),
    "gemma3": (["<start_of_turn>", "<end_of_turn>"], "<end_of_turn>"),
    "deepseek_r1": (["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"], "<｜end▁of▁sentence｜>"),
}
# templates that raise_exception unless roles alternate user/assistant after an optional system turn
ALTERNATING = {"llama2", "mistral_v0_3", "gemma3"}
# templates that render ' ' + content: the space merges into the answer's first token
SPACE_BEFORE = {"llama2", "mistral_v0_3"}


def template_tokenizer(base_dir, name):
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": TEMPLATES[name][0]})
    tokenizer.chat_template = (TEMPLATE_DIR / f"{name}.jinja").read_text()
    return tokenizer


def template_target(base_dir, name, out: Path) -> Path:
    """A target directory (config + tokenizer, no weights) whose tokenizer carries the template."""
    template_tokenizer(base_dir, name).save_pretrained(out)
    shutil.copy(Path(base_dir) / "config.json", out / "config.json")
    return out


def rendered_answer(name, messages, k) -> str:
    """What template `name` renders (and so trains) of assistant turn k of `messages`."""
    content = messages[k]["content"]
    if name in ("llama3_1", "gemma3", "llama2"):
        return content.strip()
    if name == "deepseek_r1":
        return content.split("</think>")[-1]
    if name == "qwen3":
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        reasoning = ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
        if k > last_user and k == len(messages) - 1:
            # the think block is the template's own when empty, the answer's when it holds reasoning
            if reasoning.strip("\n"):
                return "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
            return content.lstrip("\n")
        return content
    return content
