"""Chat and prompt_completion examples as token ids plus a loss mask (1 = the token counts in the loss).

prompt_completion: the prompt's ids (encode(), special tokens included, as a text document's), then
the completion's (no special tokens added), then eos. The completion and the eos count.

chat: the conversation rendered by the tokenizer's chat template (apply_chat_template, tokenize=False)
and tokenized without adding special tokens (the template writes its own), then eos. The assistant
messages count, found by rendering the conversation incrementally: for the assistant message i, its
span starts where the tokens of messages[:i] rendered with add_generation_prompt=True stop agreeing
with the whole conversation's tokens, and ends where those of messages[:i+1] do. So the role header
the generation prompt writes ("assistant:") does not count; what the template writes after the
content up to the next message (an end-of-turn token, a newline) does. The eos after the last message
counts when that message is the assistant's.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from hpcgpu.data.sources import Example
from hpcgpu.data.tokenizer import ByteTokenizer
from hpcgpu.errors import HpcgpuError

Encoded = tuple[np.ndarray, np.ndarray]  # int64 ids, uint8 mask of the same length


def check_chat_template(tokenizer: Any, where: str) -> None:
    """data.format chat needs the tokenizer's chat template; `where` names the tokenizer."""
    if not getattr(tokenizer, "chat_template", None):
        raise HpcgpuError(f"data.format: chat needs a tokenizer with a chat template, and {where} has none; "
                          "save one with the tokenizer (tokenizer.chat_template) or use data.format: "
                          "prompt_completion")


def encode_examples(tokenizer: Any, examples: list[Example], data_format: str,
                    eos: Optional[int]) -> list[Encoded]:
    if data_format == "prompt_completion":
        return encode_prompt_completions(tokenizer, examples, eos)
    if data_format == "chat":
        return [encode_chat(tokenizer, ex, eos) for ex in examples]
    raise ValueError(f"not an example format: {data_format}")


def encode_batch(tokenizer: Any, texts: list[str], special: bool) -> list[list[int]]:
    """Each text's ids; `special`: with the special tokens encode() adds (a BOS, say)."""
    if isinstance(tokenizer, ByteTokenizer):
        return [list(t.encode("utf-8")) for t in texts]
    if getattr(tokenizer, "is_fast", False):
        return list(tokenizer(texts, add_special_tokens=special, verbose=False)["input_ids"]) if texts else []
    return [list(tokenizer.encode(t, add_special_tokens=special)) for t in texts]


def with_eos(ids: list[int], mask: list[int], eos: Optional[int], counts: bool) -> Encoded:
    if eos is not None:
        ids, mask = ids + [int(eos)], mask + [int(counts)]
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)


def encode_prompt_completions(tokenizer: Any, examples: list[Example], eos: Optional[int]) -> list[Encoded]:
    prompts = encode_batch(tokenizer, [str(ex.prompt) for ex in examples], special=True)
    completions = encode_batch(tokenizer, [str(ex.completion) for ex in examples], special=False)
    return [with_eos(p + c, [0] * len(p) + [1] * len(c), eos, True) for p, c in zip(prompts, completions)]


def render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool, where: str) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # jinja raises TemplateError, a template's raise_exception() anything
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise HpcgpuError(f"{where}: the tokenizer's chat template fails on this conversation: {reason}") from None
    if not isinstance(text, str):
        raise HpcgpuError(f"{where}: the chat template did not render text")
    return text


def agreeing_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids a and b have in common."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def encode_chat(tokenizer: Any, ex: Example, eos: Optional[int]) -> Encoded:
    messages = ex.messages or []
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    texts = [render(tokenizer, messages, False, ex.where)]
    for i in turns:
        texts += [render(tokenizer, messages[:i], True, ex.where),
                  render(tokenizer, messages[: i + 1], False, ex.where)]
    encoded = [np.asarray(ids, dtype=np.int64) for ids in encode_batch(tokenizer, texts, special=False)]
    full = encoded[0]
    mask = np.zeros(len(full), dtype=np.uint8)
    for k in range(len(turns)):
        start = agreeing_prefix(encoded[1 + 2 * k], full)
        end = agreeing_prefix(encoded[2 + 2 * k], full)
        mask[start:end] = 1
    last_is_assistant = bool(turns) and turns[-1] == len(messages) - 1
    return with_eos(full.tolist(), mask.tolist(), eos, last_is_assistant)
