"""Make a tiny GPT-2 with its own tokenizer in a local folder: a model for `task: infer` with no hub.

    .venv/bin/python scripts/make_tiny_model.py runs/models/tiny-gpt2     # what configs/tiny-infer.yaml reads

The model is built from a config with random weights (seeded: the same folder every time); the
tokenizer is a byte-level BPE trained here, in memory, with the `tokenizers` library on the text in
configs/data/ (no download), wrapped as a transformers PreTrainedTokenizerFast with end-of-text and
padding tokens and a simple chat template (so rows with "messages" work, for task: infer and for
data.format: chat in configs/tiny-chat.yaml): each message renders as "ROLE: CONTENT\n", and the
generation prompt is "assistant:". Both are written with save_pretrained(), so
`AutoModelForCausalLM.from_pretrained(OUT_DIR)` and `AutoTokenizer.from_pretrained(OUT_DIR)` load them.
Its completions are noise: it was never trained. It has no dropout, so that fine-tuning it gives the
same loss curve on 1 rank and on 2 (dropout draws differ by rank).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "configs" / "data" / "pydocs.txt"
EOS, PAD = "<|endoftext|>", "<|pad|>"
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def train_tokenizer(text_file: Path, vocab_size: int):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = [line for line in text_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    tok.train_from_iterator(lines, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS,
                                   pad_token=PAD, padding_side="left")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make(out_dir: Path, seed: int = 0, vocab_size: int = 512, n_layer: int = 2, n_embd: int = 64,
         n_head: int = 2, n_positions: int = 512) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.disable_progress_bar()
    tokenizer = train_tokenizer(DATA, vocab_size)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                        n_head=n_head, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out_dir}: GPT-2, {n_layer} layers, hidden {n_embd}, {n_params / 1e6:.2f}M parameters, "
          f"BPE vocabulary {len(tokenizer)}, context {n_positions} tokens")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path, help="folder to write (created; files in it are replaced)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary (default 512)")
    parser.add_argument("--n-layer", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--n-embd", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--n-head", type=int, default=2, help="attention heads (default 2)")
    parser.add_argument("--n-positions", type=int, default=512, help="longest prompt + completion (default 512)")
    args = parser.parse_args(argv)
    if args.n_embd % args.n_head:
        parser.error("--n-embd must be a multiple of --n-head")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # transformers imports deepspeed, which would warn; unused here
    make(args.out_dir, args.seed, args.vocab_size, args.n_layer, args.n_embd, args.n_head, args.n_positions)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
