"""Answer quality figures (specdraft/demo/quality.py), pinned on hand-made answers, and measured on
the tiny target with the decode engine."""

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdraft.decode.drafters import PromptLookupDrafter
from specdraft.decode.prompts import read_prompts, stop_tokens
from specdraft.decode.report import acceptance_stats
from specdraft.decode.speculative import generate_plain, speculative_generate
from specdraft.demo.presets import PRESETS
from specdraft.demo.assets import SEED
from specdraft.demo.corpus import extract_functions, read_corpus
from specdraft.demo.quality import (
    degenerate_share,
    distinct_2,
    held_out_prompts,
    is_degenerate,
    measure_answer_quality,
    quality_of_texts,
    unseen_prompts,
)


# --- distinct-2 ------------------------------------------------------------------------------


def test_distinct_2_counts_each_pair_once_over_all_bigrams():
    # answer 1: (1,2) (2,3) (3,1) (1,2)   answer 2: (1,2) (2,9)   -> 6 bigrams, 4 different
    assert distinct_2([[1, 2, 3, 1, 2], [1, 2, 9]]) == pytest.approx(4 / 6)


def test_distinct_2_has_no_bigram_across_two_answers():
    # joined, [1, 2] + [3, 4] would add the pair (2, 3): 3 bigrams; apart: 2, both distinct
    assert distinct_2([[1, 2], [3, 4]]) == 1.0
    assert distinct_2([[5], [], [7]]) == 0.0  # no answer has two tokens


def test_distinct_2_of_a_loop_falls_with_its_length():
    line = [10, 11, 12, 13]
    assert distinct_2([line * 8]) == pytest.approx(4 / 31)  # 4 different pairs (13, 10 included)
    assert distinct_2([list(range(32))]) == 1.0


# --- degenerate answers ----------------------------------------------------------------------


def test_a_line_repeated_through_the_answer_is_degenerate():
    loop = "    self.get_name = self.get_name\n" * 8
    assert is_degenerate(loop)
    assert is_degenerate("x = f(a)\ny = 1\n  x = f(a)  \n")  # 2 of 3 lines, white space ignored


def test_more_than_a_quarter_is_the_threshold():
    six = ["a = 1", "b = 2", "c = 3", "d = 4", "e = 5", "f = 6"]
    assert is_degenerate("\n".join(six + ["a = 1"]))  # 2 of 7 lines: 2 > 7/4
    assert not is_degenerate("\n".join(six + ["g = 7", "a = 1"]))  # 2 of 8: exactly a quarter
    assert is_degenerate("\n".join(six + ["a = 1", "a = 1"]))  # 3 of 8


def test_short_and_blank_line_answers_are_not_loops():
    assert not is_degenerate("return x")
    assert not is_degenerate("if x:\n    return 1\nreturn 2")
    assert not is_degenerate("a = 1\n\n\n\nb = 2")  # blank lines do not count
    assert not is_degenerate("")


def test_degenerate_share():
    assert degenerate_share(["a\na\na", "return x", "b\nb", "x = 1\ny = 2"]) == 0.5
    assert degenerate_share([]) == 0.0


# --- on the tiny target ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_and_prompts(tiny_target_dir, tiny_data):
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    return model, tokenizer, read_prompts(tiny_data.prompts_file, tokenizer)


def test_measured_answers_are_the_greedy_answers_and_tau_is_prompt_lookups(target_and_prompts):
    model, tokenizer, prompts = target_and_prompts
    # the tiny target rarely ends its turn within 24 tokens: also stop at a token its first answer
    # produces, so that answers end and the stop token must be cut off
    first = generate_plain(model, prompts[0], max_new_tokens=24).tokens
    stop = stop_tokens(model, tokenizer) + [first[3]]
    quality, texts = measure_answer_quality(model, tokenizer, prompts, max_new_tokens=24, stop=stop)
    greedy = []
    for p in prompts:
        tokens = generate_plain(model, p, max_new_tokens=24, stop_tokens=stop).tokens
        greedy.append([t for t in tokens if t not in stop])
    assert quality.ended > 0 and len(greedy[0]) <= 3
    assert texts == [tokenizer.decode(g) for g in greedy]
    assert quality.distinct_2 == pytest.approx(distinct_2(greedy))
    assert quality.degenerate == degenerate_share(texts)
    lookup = [
        speculative_generate(model, PromptLookupDrafter(), p, max_new_tokens=24, gamma=5, stop_tokens=stop)
        for p in prompts
    ]
    assert quality.lookup_tau == pytest.approx(acceptance_stats(lookup, 5)["tau"])
    assert quality.lookup_tau >= 1.0 and quality.answers == len(prompts)
    assert "distinct-2" in quality.line() and "prompt lookup τ" in quality.line()


def test_quality_of_texts_tokenizes_with_the_targets_tokenizer(target_and_prompts):
    _, tokenizer, _ = target_and_prompts
    texts = ["x = 1\nx = 1\nx = 1", "return value"]
    quality = quality_of_texts(tokenizer, texts)
    ids = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    assert quality.distinct_2 == pytest.approx(distinct_2(ids))
    assert quality.degenerate == 0.5 and quality.lookup_tau is None


# --- which prompts ---------------------------------------------------------------------------


def test_held_out_prompts_are_the_datasets_without_building_it(tiny_data, target_and_prompts):
    _, tokenizer, _ = target_and_prompts
    written = [json.loads(line)["prompt"] for line in tiny_data.prompts_file.read_text().splitlines()]
    assert held_out_prompts(tokenizer, "tiny", SEED) == written


def test_unseen_prompts_come_from_files_the_corpus_does_not_read(target_and_prompts):
    _, tokenizer, _ = target_and_prompts
    p = PRESETS["tiny"]
    unseen = unseen_prompts(tokenizer, p.corpus_bytes, SEED, 8, p.max_prompt_tokens)
    seen = {f.prompt for f in extract_functions(read_corpus(p.corpus_bytes, SEED))}
    assert len(unseen) == 8 and len(set(unseen)) == 8 and not set(unseen) & seen
    assert all(
        len(tokenizer.apply_chat_template([{"role": "user", "content": u}], add_generation_prompt=True))
        <= p.max_prompt_tokens
        for u in unseen
    )
