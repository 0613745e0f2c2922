"""A byte-level BPE tokenizer trained on local text, wrapped as a transformers fast tokenizer."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]  # ids 0..4, in this order

# ChatML, as Qwen-style chat targets use it. A conversation renders as
#   <|bos|><|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n...<|im_end|>\n
# so an assistant turn ends with <|im_end|>, the token generation stops at.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, model_max_length: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style: every byte is a token, so any text encodes losslessly).

    A newline is always a token of its own. Otherwise "\n" would merge with the indentation
    after it, and a generation prompt ending in "<|im_start|>assistant\n" would stop inside a
    token the target only ever saw whole ("\n    "), so it would answer off-distribution.
    Isolated, the prompt's tokens are exactly a prefix of the full conversation's tokens.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split("\n", behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,  # decode(encode(x)) == x
    )
