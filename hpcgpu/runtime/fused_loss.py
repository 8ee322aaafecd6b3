"""train.fused_loss: a causal LM's training loss without its logits.

Hugging Face's loss multiplies every position's last hidden state by the output embedding, keeps the
[tokens x vocab] logits (and a float32 copy, and their log-softmax) for the backward, and only then
takes the cross entropy: at GPT-2's vocab that is 1.6 GiB a micro batch of 16 x 1024, at Llama 3's
128k vocab several times the rest of the activations. Liger's fused linear cross entropy computes the
same loss and its gradients chunk by chunk and never holds the logits. The memory it frees goes to a
larger micro batch (the memory estimate knows), the time it saves is the logits' round trips.

Only heads that are a plain linear map of the decoder's last hidden state can be fused: which model
types those are, and whether a run fuses, is the run plan's decision (runtime/plan.py).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from hpcgpu.runtime.data import IGNORE

# (head weight, hidden [n, h], targets [n], head bias) -> summed loss over the targets not IGNORE
SumLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def liger_sum_loss() -> SumLoss:
    """Liger's fused linear cross entropy (a GPU kernel in Triton), summed over the labelled tokens."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    fn = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="sum")

    # Liger's kernels run as they are, outside torch.compile's graph: the body before them compiles
    @torch.compiler.disable
    def loss(weight: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor,
             bias: torch.Tensor | None) -> torch.Tensor:
        return fn(weight, hidden, targets, bias)

    return loss


class FusedLossLM(torch.nn.Module):
    """Wraps a causal LM so that forward(input_ids, labels) returns its mean next-token loss over the
    labels that are not -100 (0 for a batch without one, as runtime/data.py's causal_lm_loss), computed
    from the last hidden states by `sum_loss`. The wrapped model keeps its own parameters and names:
    DDP and torch.compile wrap this module, checkpoints save the model inside it."""

    def __init__(self, lm: torch.nn.Module, sum_loss: SumLoss):
        super().__init__()
        self.lm = lm
        self.sum_loss = sum_loss

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        # under train.lora the LM is peft's PeftModel, whose base_model is the adapted causal LM, not its body
        inner: Any = self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm
        hidden = inner.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                  use_cache=False).last_hidden_state
        head: Any = inner.get_output_embeddings()
        h = hidden[:, :-1, :].reshape(-1, hidden.shape[-1])
        targets = labels[:, 1:].reshape(-1).to(h.device)
        total = self.sum_loss(head.weight, h, targets, head.bias)
        return total / (targets != IGNORE).sum().clamp(min=1)
