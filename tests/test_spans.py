"""Assistant spans under vendor chat templates (tests/chat_templates/): each answer is found by the
template's structure, never by searching its text, and trained exactly as rendered plus its
end-of-turn token; a property test runs random conversations through every template."""

import random

import pytest

from chat_template_cases import ALTERNATING, SPACE_BEFORE, TEMPLATES, rendered_answer, template_tokenizer
from specdraft.data.chat import assistant_spans, tokenize_conversation
from specdraft.data.sources import SkippedRow
from specdraft.commands.data_report import runs


@pytest.fixture(scope="module")
def tokenizers(tiny_target_dir):
    return {name: template_tokenizer(tiny_target_dir, name) for name in TEMPLATES}


def trained_runs(tokenizer, ids, mask):
    return [tokenizer.decode(p) for trained, p in runs(ids, mask) if trained]


def expected_runs(name, messages):
    """Each non-empty rendered answer + its end-of-turn."""
    end = TEMPLATES[name][1]
    answers = [rendered_answer(name, messages, k) for k, m in enumerate(messages) if m["role"] == "assistant"]
    return [a + end for a in answers if a.strip()]


def assert_runs(name, got, expected):
    """' ' + content templates: the space before an answer rides in its first token when the
    tokenizer merges them (' word'), so the run may start with that one space."""
    if name in SPACE_BEFORE:
        got = [run[1:] if run.startswith(" ") and run[1:] == want else run for run, want in zip(got, expected)] + got[
            len(expected) :
        ]
    assert got == expected


def checked_runs(name, tokenizer, messages):
    """The trained runs of `messages`, checked against what the template renders of each answer."""
    ids, mask = tokenize_conversation(tokenizer, messages, "x")
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)
    got = trained_runs(tokenizer, ids, mask)
    assert_runs(name, got, expected_runs(name, messages))
    return got


def conv(*turns, system=None):
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]


ROLE_WORDS = ["a", "end", "start", "assistant", "user", "model", "system", "im", "|", "<", "INST", "eot", "[/INST]"]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("answer", ROLE_WORDS)
def test_answers_equal_to_header_words_are_found_in_their_own_turn(tokenizers, name, answer):
    checked_runs(name, tokenizers[name], conv("start", answer, "assistant", answer, system="system"))


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_whitespace_padded_answers_train_what_the_template_renders(tokenizers, name):
    runs_ = checked_runs(name, tokenizers[name], conv("q", "  padded answer \n", "q2", "\n\tx\n"))
    if name in ("llama3_1", "gemma3", "llama2"):  # `| trim` / .strip(): the trimmed text is trained
        assert runs_[0].strip().startswith("padded answer") and "  padded" not in runs_[0]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_think_blocks_follow_the_templates_history_rules(tokenizers, name):
    messages = conv("q", "<think>\nfirst thought\n</think>\n\nfirst", "q2", "<think>\nlast thought\n</think>\n\nlast")
    got = checked_runs(name, tokenizers[name], messages)
    if name == "qwen3":  # history loses its reasoning; the last turn keeps its think block, opener included
        assert got == ["first<|im_end|>", "<think>\nlast thought\n</think>\n\nlast<|im_end|>"]
    if name == "deepseek_r1":  # every turn loses its reasoning, the newlines after </think> stay
        assert got == ["\n\nfirst<｜end▁of▁sentence｜>", "\n\nlast<｜end▁of▁sentence｜>"]


def test_qwen3_last_turn_without_reasoning_trains_the_answer_not_the_templates_empty_think_block(tokenizers):
    tokenizer = tokenizers["qwen3"]
    messages = conv("q", "plain")
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text.endswith("assistant\n<think>\n\n</think>\n\nplain<|im_end|>\n")
    ids, mask = tokenize_conversation(tokenizer, messages, "x")
    assert trained_runs(tokenizer, ids, mask) == ["plain<|im_end|>"]


@pytest.mark.parametrize("name", ["gemma3", "mistral_v0_3", "llama2", "deepseek_r1"])
def test_a_folded_system_prompt_equal_to_the_answer_is_not_taken_for_it(tokenizers, name):
    # Gemma folds the system prompt into the first user turn, Mistral v0.3 into the last, Llama-2 into
    # <<SYS>>, R1 puts it before the first turn: the same words as the answer, earlier in the render
    tokenizer = tokenizers[name]
    messages = conv("ok", "ok", system="ok")
    ids, mask = tokenize_conversation(tokenizer, messages, "x")
    assert_runs(name, trained_runs(tokenizer, ids, mask), expected_runs(name, messages))
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    (span,) = assistant_spans(tokenizer, messages, "x")
    assert text.count("ok") >= 2 and span.start == text.rindex("ok")


@pytest.mark.parametrize("name", ["llama2", "mistral_v0_3"])
def test_space_before_the_answer_the_token_holding_its_first_character_is_trained(tokenizers, name):
    tokenizer = tokenizers[name]
    messages = conv("q", "word")
    ids, mask = tokenize_conversation(tokenizer, messages, "x")
    first = mask.index(1)
    assert tokenizer.convert_ids_to_tokens(ids[first]) == "Ġw"  # ' ' + 'w': one token, trained
    assert trained_runs(tokenizer, ids, mask) == [" word" + TEMPLATES[name][1]]


def test_tokens_straddling_the_answers_borders_are_trained(tokenizers):
    # a template that glues letters to both sides of the answer: BPE merges across its borders
    tokenizer = template_tokenizer_with(
        tokenizers["qwen2_5"], "{% for m in messages %}{{ m['role'] + ':r' + m['content'] + 'ng.' }}{% endfor %}"
    )
    messages = conv("q", "ead thi")  # rendered ":read thing.": 'read' and 'ing' cross the borders
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    (span,) = assistant_spans(tokenizer, messages, "x")
    assert text[span.start : span.end] == "ead thi" and span.stop == span.end  # no end-of-turn token here
    ids, mask = tokenize_conversation(tokenizer, messages, "x")
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    straddling = [j for j, (a, b) in enumerate(offsets) if a < span.start < b or a < span.end < b]
    assert len(straddling) == 2  # one token across each border (the test's premise)
    for j, (a, b) in enumerate(offsets):
        assert mask[j] == int(a < span.end and b > span.start), (j, text[a:b])


def template_tokenizer_with(tokenizer, template):
    import copy

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize("name", sorted(ALTERNATING))
def test_assistant_first_rows_the_template_refuses_are_skipped_rows(tokenizers, name):
    messages = [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "x"}]
    with pytest.raises(SkippedRow, match=r"^r\.jsonl:3: the chat template cannot render this conversation: ") as err:
        tokenize_conversation(tokenizers[name], messages, "r.jsonl:3")
    assert err.value.reason == "template refused" and err.value.where == "r.jsonl:3"


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_generated_ids_are_placed_at_the_answer_never_in_a_header(tokenizers, name):
    tokenizer = tokenizers[name]
    for answer in ("a", "start", "end", "assistant"):
        messages = conv("start", answer)
        given = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(ch))[0] for ch in answer]
        end_id = tokenizer.convert_tokens_to_ids(TEMPLATES[name][1].strip())
        messages[-1]["token_ids"] = given + [end_id]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        ids, mask = tokenize_conversation(tokenizer, messages, "x")
        (span,) = assistant_spans(tokenizer, messages, "x")
        at = len(tokenizer(text[: span.start], add_special_tokens=False)["input_ids"])
        assert ids[at : at + len(given)] == given, (name, answer)
        assert tokenizer.decode(ids[:at]) == text[: span.start]
        assert tokenizer.decode(ids) == text


# --- the property test -------------------------------------------------------------------------
PIECES = ROLE_WORDS + ["\n", "Hello world.", "def f():\n    return 1", "x = 1", "<think>", "</s>", "42"]
PADS = ["", "", " ", "  ", "\n", "\n\n", "\t", " \n "]


def random_answer(rng):
    body = "".join(rng.choice(PIECES) + rng.choice(["", " ", "\n"]) for _ in range(rng.randint(0, 3)))
    answer = rng.choice(PADS) + body + rng.choice(PADS)
    if rng.random() < 0.25:
        answer = f"<think>\n{rng.choice(PIECES)}\n</think>\n\n" + answer
    return answer


def random_conversation(rng):
    turns = []
    for _ in range(rng.randint(1, 3)):
        turns += [rng.choice(PIECES[:8] + ["What now?", "q"]), random_answer(rng)]
    return conv(*turns, system=rng.choice([None, None, "Be brief.", "assistant"]))


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_random_conversations_train_exactly_the_rendered_answers(tokenizers, name):
    tokenizer = tokenizers[name]
    end_ids = set(tokenizer.all_special_ids)
    rng = random.Random(31 + sorted(TEMPLATES).index(name))
    checked = skipped = 0
    for _ in range(150):
        messages = random_conversation(rng)
        expected = expected_runs(name, messages)
        try:
            ids, mask = tokenize_conversation(tokenizer, messages, "x")
        except SkippedRow as skip:
            assert not expected and skip.reason == "empty answer", (messages, skip)
            skipped += 1
            continue
        assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)
        assert_runs(name, trained_runs(tokenizer, ids, mask), expected)
        # a special token is trained only as an answer's end-of-turn or inside an answer: never a header's
        eot = tokenizer.convert_tokens_to_ids(TEMPLATES[name][1].strip())
        in_answers = {t for a in expected for t in tokenizer(a, add_special_tokens=False)["input_ids"]}
        assert {t for t, m in zip(ids, mask) if m and t in end_ids} <= {eot} | in_answers
        checked += 1
    assert checked > 100 and skipped > 0


@pytest.mark.parametrize("name", ["llama3_1", "gemma3", "qwen3"])
def test_generated_ids_of_an_answer_the_template_rewrites_give_way_to_its_rendered_text(tokenizers, name):
    # trim drops the padding, Qwen3 drops the reasoning of a history turn: the ids are not the text
    # trained, so the rendered text is tokenised instead
    tokenizer = tokenizers[name]
    content = "  <think>\nhm\n</think>\n\nword  " if name != "qwen3" else "<think>\nhm\n</think>\n\nword"
    messages = conv("q", content, "q2", "last")
    messages[1]["token_ids"] = tokenizer(content, add_special_tokens=False)["input_ids"]
    checked_runs(name, tokenizer, messages)


@pytest.mark.parametrize("name", ["qwen2_5", "llama2"])
def test_a_truncated_answer_is_trained_without_its_end_of_turn(tokenizers, tmp_path, name):
    from specdraft.data.sources import iter_conversations

    tokenizer = tokenizers[name]
    path = tmp_path / "r.jsonl"
    path.write_text(
        '{"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "cut he", '
        '"truncated": true}, {"role": "user", "content": "q2"}, {"role": "assistant", "content": "whole"}]}\n'
    )
    ((where, messages),) = iter_conversations([str(path)])
    ids, mask = tokenize_conversation(tokenizer, messages, where)
    assert_runs(name, trained_runs(tokenizer, ids, mask), ["cut he", "whole" + TEMPLATES[name][1]])
