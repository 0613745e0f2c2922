"""bench/acceptance.py --context N: each prompt after earlier conversations, N tokens in all."""

import pytest

from specdraft.decode.prompts import pad_with_earlier_conversations
from specdraft.errors import SpecdraftError


def test_the_prompt_is_last_earlier_conversations_before_it_newest_nearest_and_the_total_exact():
    prompt = [100, 101, 102]
    earlier = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    padded = pad_with_earlier_conversations(prompt, earlier, 12)
    assert len(padded) == 12
    assert padded[-3:] == prompt  # the prompt's tokens last
    assert padded[-7:-3] == [1, 2, 3, 4]  # the newest earlier conversation whole, just before it
    assert padded[-10:-7] == [5, 6, 7]  # then the next, whole
    assert padded[:2] == [11, 12]  # only the oldest used is cut, and from its start


def test_a_conversation_that_fits_exactly_is_not_cut_and_none_after_it_is_read():
    padded = pad_with_earlier_conversations([9], [[1, 2], [3, 4]], 5)
    assert padded == [3, 4, 1, 2, 9]
    assert pad_with_earlier_conversations([9], [[1, 2], [3, 4], [5]], 3) == [1, 2, 9]


def test_too_few_earlier_tokens_or_a_prompt_already_that_long_is_one_line():
    with pytest.raises(SpecdraftError, match=r"--context 10: the earlier conversations hold 4 tokens, 4 short"):
        pad_with_earlier_conversations([7, 8], [[1, 2], [3, 4]], 10)
    with pytest.raises(SpecdraftError, match=r"--context 2: a prompt is already 3 tokens long"):
        pad_with_earlier_conversations([1, 2, 3], [[4]], 2)
