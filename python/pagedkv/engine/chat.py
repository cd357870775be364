"""LLM.chat's input: conversations of {"role", "content"} messages rendered with the tokenizer's
chat template (HF's apply_chat_template) into prompt dicts, text and token ids."""

from __future__ import annotations

from typing import Any, Mapping


def conversations_of(messages) -> list[list[Mapping]]:
    """One conversation (a list of message dicts) or a batch (a list of such lists), as a list of
    conversations; ValueError/TypeError naming what is wrong."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError("pagedkv.LLM.chat: messages must be a non-empty list of {'role', 'content'} dicts "
                        f"(one conversation) or a list of such lists (a batch), got {messages!r:.80}")
    batch = [messages] if isinstance(messages[0], Mapping) else list(messages)
    for c, conversation in enumerate(batch):
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise TypeError(f"pagedkv.LLM.chat: conversation {c} must be a non-empty list of "
                            f"{{'role', 'content'}} dicts, got {conversation!r:.80}")
        for m, message in enumerate(conversation):
            if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
                raise ValueError(f"pagedkv.LLM.chat: message {m} of conversation {c} must be a dict with "
                                 f"the keys 'role' and 'content', got {message!r:.80}")
    return batch


def chat_prompts(tokenizer, messages, chat_template: str | None, add_generation_prompt: bool,
                 continue_final_message: bool, tools: list | None,
                 chat_template_kwargs: dict[str, Any] | None) -> list[dict]:
    """A {"prompt": rendered text, "prompt_token_ids": its ids} per conversation (the ids as
    apply_chat_template tokenizes: the template's own special tokens, none added)."""
    batch = conversations_of(messages)
    if tokenizer is None:
        raise ValueError("pagedkv.LLM.chat needs a tokenizer with a chat template: pass tokenizer= to "
                         "pagedkv.LLM (or use generate() with token ids)")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("pagedkv.LLM.chat: the tokenizer has no chat template; pass chat_template= (a "
                         "Jinja template string) or use a chat model's tokenizer")
    kwargs = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                  continue_final_message=continue_final_message, tools=tools, **(chat_template_kwargs or {}))
    prompts = []
    for conversation in batch:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
        ids = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False, **kwargs)
        prompts.append({"prompt": text, "prompt_token_ids": list(ids)})
    return prompts
