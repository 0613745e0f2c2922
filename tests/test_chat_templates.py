"""Assistant masks under the chat templates of real target families.

The templates are written here from each family's documented rules (shared REFERENCE.md), not
copied from vendors. For each: a multi-turn conversation with a system prompt; the masked tokens
decode to exactly each assistant turn's text plus its end-of-turn token, nothing else.
"""

import pytest
from transformers import AutoTokenizer

from specdraft.data.chat import render_prompt, tokenize_conversation
from specdraft.data.sources import iter_conversations
from specdraft.errors import SpecdraftError

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen3: think blocks of assistant turns before the last user message are dropped; turns after it
# render one (empty when the turn has no reasoning); enable_thinking=False opens an empty one.
QWEN3 = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}"
    "{% set content = m['content'] %}{% set reasoning = '' %}"
    "{% if '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{% if loop.index0 > ns.last_user %}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)

LLAMA31 = (
    "{{ '<|begin_of_text|>' }}"
    "{% set system = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\n"
    "Today Date: 26 Jul 2024\\n\\n' + system + '<|eot_id|>' }}"
    "{% for m in messages %}{% if m['role'] != 'system' %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

GEMMA = (
    "{{ '<bos>' }}"
    "{% set system = messages[0]['content'] + '\\n\\n' if messages[0]['role'] == 'system' else '' %}"
    "{% for m in messages %}{% if m['role'] != 'system' %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{% set first_user = system if (m['role'] == 'user' and loop.index0 <= 1) else '' %}"
    "{{ '<start_of_turn>' + role + '\\n' + first_user + m['content'] + '<end_of_turn>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

MISTRAL = (
    "{{ '<s>' }}"
    "{% set system = messages[0]['content'] + '\\n\\n' if messages[0]['role'] == 'system' else '' %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '[INST] ' + (system if loop.index0 <= 1 else '') + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] + '</s>' }}{% endif %}"
    "{% endfor %}"
)

DEEPSEEK_R1 = (
    "{{ '<｜begin▁of▁sentence｜>' }}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}"
    "{% set content = m['content'].split('</think>')[-1] if '</think>' in m['content'] else m['content'] %}"
    "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

FAMILIES = {
    # name: (template, special tokens, end-of-turn token, eos)
    "chatml-qwen2.5": (CHATML, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    "qwen3": (QWEN3, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    "llama-3.1": (
        LLAMA31,
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|eot_id|>",
    ),
    "gemma": (GEMMA, ["<bos>", "<start_of_turn>", "<end_of_turn>"], "<end_of_turn>"),
    "mistral": (MISTRAL, ["<s>", "</s>", "[INST]", "[/INST]"], "</s>"),
    "deepseek-r1": (
        DEEPSEEK_R1,
        ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"],
        "<｜end▁of▁sentence｜>",
    ),
}

CONVERSATION = [
    {"role": "system", "content": "You write short Python."},
    {"role": "user", "content": "Add two numbers."},
    {"role": "assistant", "content": "<think>\nsum them\n</think>\n\ndef add(a, b):\n    return a + b"},
    {"role": "user", "content": "Now subtract."},
    {"role": "assistant", "content": "<think>\ndifference\n</think>\n\ndef sub(a, b):\n    return a - b"},
    {"role": "user", "content": "And multiply?"},
    {"role": "assistant", "content": "def mul(a, b):\n    return a * b"},
]


def family_tokenizer(base_dir, family):
    template, specials, _ = FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tiny_target_dir):
    return request.param, family_tokenizer(tiny_target_dir, request.param)


def expected_answers(family, messages):
    """What each family renders of each answer: reasoning dropped from history where the family does."""
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    out = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        text = m["content"]
        strip = (family == "qwen3" and i < last_user) or family == "deepseek-r1"
        if strip and "</think>" in text:
            text = text.split("</think>")[-1].lstrip("\n") if family == "qwen3" else text.split("</think>")[-1]
        out.append(text)
    return out


def masked_runs(tokenizer, ids, mask):
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(r) for r in runs]


def test_masked_tokens_are_each_answer_plus_its_end_of_turn(family):
    name, tokenizer = family
    _, _, end = FAMILIES[name]
    ids, mask = tokenize_conversation(tokenizer, CONVERSATION, "conv.jsonl:1")
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.decode(ids) == text  # the one render, tokenised whole
    assert masked_runs(tokenizer, ids, mask) == [a + end for a in expected_answers(name, CONVERSATION)]


def test_qwen3_history_is_not_a_prefix_of_the_whole_render(tiny_target_dir):
    # why the one render: a prefix render keeps the first turn's think block, the whole one drops it
    tokenizer = family_tokenizer(tiny_target_dir, "qwen3")
    prefix = tokenizer.apply_chat_template(CONVERSATION[:3], tokenize=False)
    whole = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert not whole.startswith(prefix)


def test_generated_token_ids_are_used_as_given(family):
    name, tokenizer = family
    _, _, end = FAMILIES[name]
    answer = "def mul(a, b):\n    return a * b"
    # ids that decode to the answer but are not what tokenising it gives (one token per character)
    given = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(ch))[0] for ch in answer]
    assert given != tokenizer(answer, add_special_tokens=False)["input_ids"]
    end_id = tokenizer.convert_tokens_to_ids(end)
    messages = CONVERSATION[:-1] + [{"role": "assistant", "content": answer, "token_ids": given + [end_id]}]
    ids, mask = tokenize_conversation(tokenizer, messages, "x")
    masked = [t for t, m in zip(ids, mask) if m]
    assert masked[-len(given) - 1 :] == given + [end_id]
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)


def test_eval_prompts_render_with_the_thinking_setting(tiny_target_dir):
    tokenizer = family_tokenizer(tiny_target_dir, "qwen3")
    user = [{"role": "user", "content": "hi"}]
    assert render_prompt(tokenizer, user, "x", thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert render_prompt(tokenizer, user, "x", thinking=True).endswith("<|im_start|>assistant\n")
    from specdraft.decode.prompts import encode_messages

    assert tokenizer.decode(encode_messages(tokenizer, user, thinking=False)).endswith("</think>\n\n")


def test_a_conversation_the_template_cannot_render_names_file_and_line(tiny_target_dir, tmp_path):
    tokenizer = family_tokenizer(tiny_target_dir, "chatml-qwen2.5")
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    path = tmp_path / "d.jsonl"
    path.write_text('{"conversations": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n')
    ((where, messages),) = iter_conversations([str(path)])
    with pytest.raises(SpecdraftError, match=rf"^{path}:1: the chat template cannot render .*roles must alternate$"):
        tokenize_conversation(tokenizer, messages, where)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"  # drops the text
    with pytest.raises(SpecdraftError, match=rf"^{path}:1: assistant turn 1 does not appear"):
        tokenize_conversation(tokenizer, messages, where)
