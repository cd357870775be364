"""A real HF tokenizer (PreTrainedTokenizerFast) for the tiny test models, built in memory: one
token per printable character, ids past those decode to two letters, <s> (1) and </s> (2) special,
BOS added by encode(), and a small chat template that writes the BOS itself."""

from __future__ import annotations

import functools
import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@functools.lru_cache(maxsize=None)
def char_tokenizer(vocab_size: int = 256, chat_template: bool = True) -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for c in string.printable[:95] + "\n":
        vocab.setdefault(c, len(vocab))
    letters = string.ascii_lowercase
    i = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(letters[i // 26 % 26] + letters[i % 26] + "~", len(vocab))
        i += 1
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat_template:
        tok.chat_template = CHAT_TEMPLATE
    return tok
