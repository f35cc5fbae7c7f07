"""The next-token loss, computed a chunk of tokens at a time: no [tokens, vocab] float32 tensor ever exists whole.

Llama 3's head maps each token to 128,256 logits; at 8,192 tokens and micro batch 2 their float32 copy alone is
8.4 GB, and the softmax and its gradient as much again. Here the head and the cross-entropy run over
`chunk_tokens` tokens at a time, and each chunk's logits are dropped as soon as its loss is summed: the backward
pass computes them again, one chunk at a time (activation checkpointing of the head), at the cost of one more
head matmul per token. One chunk (a batch of at most `chunk_tokens` tokens) is today's computation as it was.

`head` is called as a module, so whatever a strategy hung on it works unchanged: a tensor-parallel head's
vocabulary-split logits (loss parallel, when the caller is inside torch's `loss_parallel()` context) and a
sharded data-parallel root's gathered weights alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# A target the loss leaves out (summed as zero; still counted in the mean's denominator): a padding row's.
IGNORED = -100


def chunked_cross_entropy(
    hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """Mean cross-entropy of `head(hidden)` against `targets`: hidden [B, T, dim] (after the final norm),
    targets [B, T]. The chunks are spans of positions across every row, so that a [B, T, dim] tensor whose
    batch or feature dimension a strategy split keeps its layout."""
    rows, length = targets.shape
    span = max(1, chunk_tokens // rows)  # positions per chunk
    if span >= length:
        return _summed_loss(head, hidden, targets) / targets.numel()
    chunks = [
        checkpoint(
            _summed_loss, head, hidden[:, start : start + span], targets[:, start : start + span], use_reentrant=False
        )  # fmt: skip
        for start in range(0, length, span)
    ]
    return torch.stack(chunks).sum() / targets.numel()


def _summed_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden)
    # Summed, not averaged: chunks of unequal size then add up to the mean over every token.
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum", ignore_index=IGNORED)


def chunked_target_log_probs(
    hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """[2, B, T] float32 for targets [B, T]: each target's log-probability under `head(hidden)` (0 where IGNORED),
    and the highest log-probability of any token at that position. Chunked as the loss; no gradient.

    Both are taken of one log-softmax, so that "the target is ranked first" is an exact comparison; with
    vocabulary-split logits (loss parallel) each is an op the split supports, and the result is split as the
    loss is (the caller makes it whole: `target_scores` wants plain tensors)."""
    rows, length = targets.shape
    span = max(1, chunk_tokens // rows)
    parts = []
    with torch.no_grad():
        for start in range(0, length, span):
            part = targets[:, start : start + span]
            log_probs = head(hidden[:, start : start + span]).float().log_softmax(dim=-1)
            picked = -F.nll_loss(log_probs.flatten(0, 1), part.flatten(), reduction="none", ignore_index=IGNORED)
            parts.append(torch.stack([picked.view(part.shape), log_probs.amax(dim=-1)]))
    return torch.cat(parts, dim=2)


# The columns of `target_scores`' rows.
SCORE_COLUMNS = ("log_probability", "targets", "ranked_first")


def target_scores(log_probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[B, 3] float64 from `chunked_target_log_probs`' [2, B, T] (plain tensors): for each row, the sum of its
    targets' log-probabilities, how many targets it has, and how many of them no other token outranks (a row whose
    last two counts are equal is the model's greedy continuation)."""
    picked, best = log_probs.double()
    real = targets != IGNORED
    first = (picked >= best) & real  # a tie with another token counts as first (the harness's argmax: the lower id)
    return torch.stack([picked.sum(dim=1), real.sum(dim=1).double(), first.sum(dim=1).double()], dim=1)
