"""The data of configs/tiny-lora-chat.yaml: chat rows asking to reverse a word, answered with the word
spelled backwards ("Reverse candle." -> "eldnac"), for the words configs/data/chat.jsonl spells.

The base that configs/tiny-chat.yaml trains on chat.jsonl has learnt to spell those words; the LoRA
adapter teaches it to write them backwards, which a sample shows at a glance. Deterministic (a fixed
seed): the shipped files are exactly what this writes (tests/unit/test_examples_lora.py checks it).

    .venv/bin/python -m examples.reverse_chat      # rewrite configs/data/reverse-chat*.jsonl
"""
from __future__ import annotations

import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "configs" / "data"
WORDS = ("apple", "bridge", "candle", "castle", "cloud", "forest", "garden", "ocean", "pencil", "river",
         "rocket", "silver", "stone", "tiger", "violin", "window")
ASKS = ("Reverse {}.", "Write {} backwards.", "What is {} spelled backwards?")
REPEATS = 7  # each (word, question) pair: 16 x 3 x 7 = 336 rows
SAMPLE_WORDS = ("candle", "rocket", "garden", "violin")  # the prompts of the sample (reverse-prompts.jsonl)


def conversation(ask: str, word: str) -> dict:
    return {"messages": [{"role": "user", "content": ask.format(word)},
                         {"role": "assistant", "content": word[::-1]}]}


def rows() -> list[dict]:
    out = [conversation(ask, word) for word in WORDS for ask in ASKS] * REPEATS
    random.Random(0).shuffle(out)
    return out


def prompts() -> list[dict]:
    """Infer rows for a sample: the first question of each SAMPLE_WORDS word."""
    return [{"id": word, "messages": [{"role": "user", "content": ASKS[0].format(word)}]} for word in SAMPLE_WORDS]


def jsonl(items: list[dict]) -> str:
    return "".join(json.dumps(item) + "\n" for item in items)


def main() -> None:
    (DATA / "reverse-chat.jsonl").write_text(jsonl(rows()))
    (DATA / "reverse-prompts.jsonl").write_text(jsonl(prompts()))


if __name__ == "__main__":
    main()
