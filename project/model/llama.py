"""A single-device Llama: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU; a KV cache for decoding.

Plain PyTorch on purpose: parallelism is applied from outside (project.parallel), so nothing here
imports torch.distributed, Lightning or Hydra. Weight names and the rotary layout (rotate-half)
match Hugging Face's LlamaForCausalLM, so export is a rename and no permutation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from project.model.config import LlamaConfig
from project.model.document_mask import BlockMask, document_mask
from project.model.initial_values import matrix_shape, normal_values
from project.model.kernels import attend
from project.model.loss import chunked_cross_entropy, chunked_target_log_probs
from project.model.spec import own_name


def rope_frequencies(config: LlamaConfig, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32, with Llama-3.1 scaling when configured.

    Computed in float32 like Hugging Face's, so that exported models rotate identically.
    """
    exponents = torch.arange(0, config.head_dim, 2, device=device, dtype=torch.float32) / config.head_dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    s = config.rope_scaling
    if s is None:
        return inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
        s["high_freq_factor"] - s["low_freq_factor"]
    )
    interpolated = (1 - smooth) * inv_freq / s["factor"] + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s["factor"], interpolated)
    return torch.where(wavelen < high_wavelen, inv_freq, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalized in float32 whatever the activation dtype, then scaled in the activations' own, as Meta and HF do.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).type_as(x)


class LayerKV:
    """One layer's keys and values [B, n_kv_heads, max_len, head_dim], filled up to `length`.

    Kept before the grouped-query repeat, so a cache of n_kv_heads < n_heads is that much smaller.
    """

    def __init__(self, shape: tuple[int, ...], device: torch.device | None, dtype: torch.dtype | None):
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' k and v; return those of every position so far."""
        end = self.length + k.shape[2]
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Keys and values of every layer for the tokens decoded so far: with it, each new token costs one
    position's work instead of re-running the whole sequence. `Llama.forward(tokens, cache=cache)`
    reads the cached positions and appends the new ones."""

    def __init__(
        self,
        config: LlamaConfig,
        batch_size: int,
        max_len: int,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        shape = (batch_size, config.kv_heads, max_len, config.head_dim)
        self.layers = [LayerKV(shape, device, dtype) for _ in range(config.n_layers)]
        self.max_len = max_len

    @property
    def length(self) -> int:
        """Positions cached so far: the position of the next token."""
        return self.layers[0].length


class ScaledDotProduct(nn.Module):
    """softmax(q k^T / sqrt(head_dim) + mask) v: q [B, H, T, D] over k, v [B, H_kv, S, D] (S = T but with a cache),
    by the kernel project.model.kernels chooses.

    A module of its own, without parameters, so that a strategy can reach the one place attention is computed:
    context parallelism (project.parallel.context_parallel) gives it every rank's keys and values first."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask | None
    ) -> torch.Tensor:
        return attend(q, k, v, mask)


class DocumentMasking(nn.Module):
    """The attention mask of packed documents, from their ids [B, T] (project.model.document_mask), and the positions
    of the queries the model holds.

    A module of its own, without parameters, so that a strategy whose ranks keep some of each sequence's queries
    (context parallelism) can make the mask of those rows only, and the model rotate them by their own positions."""

    def forward(self, document_ids: torch.Tensor) -> torch.Tensor | BlockMask:
        return document_mask(document_ids)

    def queries(self, rows: int, device: torch.device) -> tuple[torch.Tensor, int]:
        """The positions [rows] in the whole sequence of the `rows` queries this rank holds, and the whole sequence's
        length: all of it, in order (a strategy that splits sequences says which)."""
        return torch.arange(rows, device=device), rows


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)
        self.attend = ScaledDotProduct()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: Any,  # the model's attention_mask
        cache: LayerKV | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.heads(x)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k, mask = self.positioned(q, k, cos, sin, mask)
        if cache is not None:
            k, v = cache.append(k, v)
        out = self.attend(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))

    def positioned(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | BlockMask | None]:
        """Queries and keys [B, heads, T, head_dim] at their positions (rotated by the rotary embedding), and the mask
        they attend under: the model's `mask` (a family whose layers differ in either, as Llama 4's, does it here)."""
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, mask

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values [B, T, heads, head_dim] of x [B, T, dim], before the rotary embedding (a family
        whose attention treats them first, such as a per-head norm, does it here)."""
        B, T, _ = x.shape
        # -1 instead of the head counts: under tensor parallelism each rank holds a slice of the heads.
        shape = (B, T, -1, self.head_dim)
        return self.wq(x).view(shape), self.wk(x).view(shape), self.wv(x).view(shape)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: LlamaConfig, hidden_dim: int | None = None):
        super().__init__()
        hidden = config.ffn_hidden_dim if hidden_dim is None else hidden_dim
        self.w1 = nn.Linear(config.dim, hidden, bias=False)
        self.w3 = nn.Linear(config.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig, feed_forward: nn.Module | None = None, attention: nn.Module | None = None):
        """`feed_forward`: another family's (a mixture of experts) in place of the SwiGLU, taking and giving
        [B, T, dim]; `attention`: another family's in place of grouped-query attention, taking Attention's inputs."""
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config) if attention is None else attention
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config) if feed_forward is None else feed_forward

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: Any,  # the model's attention_mask
        cache: LayerKV | None = None,
    ) -> torch.Tensor:
        # By keyword: tensor parallelism's input hook on `attention` lays out the four positional inputs only.
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, cache=cache)
        return x + self.feed_forward(self.ffn_norm(x))


class Mixture(Protocol):
    """A mixture-of-experts feed-forward as strategies see it (FamilyHooks.mixtures): two parts they may replace and
    one whose outputs they may see.
    `experts`: (tokens sorted by expert [M, dim], counts per expert) -> outputs [M, dim], and its `products`, the
    same of stacked weights given (w1, w3: [n, hidden, dim]; w2: [n, dim, hidden]; expert and tensor parallelism
    give each rank its part);
    `sequence_sums`: per-sequence sums of the balancing loss (context parallelism sums them over the group);
    `router`: tokens [N, dim] -> (scores [N, n] float32, chosen experts [N, top_k], their weights [N, top_k]) (tensor
    parallelism makes a group's ranks route alike)."""

    experts: nn.Module
    sequence_sums: nn.Module
    router: nn.Module


class FamilyHooks(Protocol):
    """What a family's model adds to training beyond a Llama's, for the module, the strategies and the callbacks to
    call (`Llama.hooks`; None where a family adds nothing, as the dense Llama and Qwen3). A mixture of experts
    (project.model.families.moe) adds its balancing loss, its experts' loads and its stacked experts."""

    def init_buffers(self) -> None:
        """The initial values of the model's state that is not trained by gradients (to_empty leaves it unset; a
        strategy that shards the parameters calls this after drawing them)."""
        ...

    def mixtures(self) -> Sequence[Mixture]:
        """The mixture-of-experts feed-forwards of the blocks this model holds, in order."""
        ...

    def with_auxiliary_losses(self, loss: torch.Tensor) -> torch.Tensor:
        """The training objective of the forward that just computed `loss` (its mean next-token loss, a plain
        tensor): `loss` with the gradient of the model's own losses joined, its value unchanged."""
        ...

    def stage_output(self, h: torch.Tensor) -> torch.Tensor:
        """A pipeline stage's output hidden states (project.parallel.pipeline), joined to the model's own losses its
        blocks computed."""
        ...

    def stacked_parameters(self) -> dict[str, tuple[int, list[nn.Parameter]]]:
        """Parameters that stack several of a layer's parts along dim 0, for numerics per part: {name: (parts, the
        tensors this model holds)}, one entry per such layer of the whole model (a pipeline stage holds some: the
        others' lists are empty)."""
        ...

    def step_statistics(
        self, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor], report: bool, applied: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """What the model gathered over an optimizer step's forward passes, after their backward: summed over every
        rank with `sum_over_ranks`, acted on where the step's update is `applied` (a flag on the device; None:
        applied), and with `report` as metrics to log."""
        ...


class Llama(nn.Module):
    # What a family's model adds to training (FamilyHooks), or None: a dense Llama adds nothing.
    hooks: FamilyHooks | None = None

    def __init__(self, config: LlamaConfig, init_seed: int = 0):
        super().__init__()
        self.config = config
        # Each parameter's initial value comes from generators of its own, one per tile, keyed by `init_seed`, the
        # parameter's name and the tile's place (project.model.initial_values): not from torch's global generator,
        # which whatever ran before in the process (preparing data, a conversion, an import) may have drawn from.
        # So the weights depend on neither that, nor the order or device they are initialized on, nor their shards.
        self.init_seed = init_seed
        self.tensor_specs = {t.name: t for t in config.tensors()}
        # Built on the meta device, so that the layers' own initialization (drawn, then replaced by ours) costs
        # nothing; then given memory where the model was asked for, unless that is the meta device too (a
        # strategy that shards the model gives it memory, and its values, after sharding).
        device = torch.get_default_device()
        with torch.device("meta"):
            self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
            # A ModuleDict keyed by layer index keeps names stable when pipeline stages drop layers.
            self.layers = nn.ModuleDict({str(i): self.block(config, i) for i in range(config.n_layers)})
            self.norm = RMSNorm(config.dim, config.norm_eps)
            self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.document_masking = DocumentMasking()
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        if device.type != "meta":
            self.to_empty(device=device)
            self.init_weights()

    def block(self, config: LlamaConfig, index: int) -> Block:
        """Block `index` of the model (a family whose blocks differ builds its own)."""
        return Block(config)

    def to_empty(self, *, device: torch.device | str | int | None, recurse: bool = True) -> "Llama":
        super().to_empty(device=device, recurse=recurse)
        # nn.Module.to_empty gives each module a Parameter of its own: a tied head would come apart.
        if self.config.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight
        return self

    @torch.no_grad()
    def init_weights(self) -> None:
        for name, p in self.named_parameters():
            if p.device.type == "cpu" and p.is_contiguous():  # drawn in place
                self.initial_value(name, out=p.view(matrix_shape(p.shape)))
            else:
                p.copy_(self.initial_value(name))
        if self.hooks is not None:
            self.hooks.init_buffers()

    def initial_value(
        self,
        name: str,
        rows: torch.Tensor | None = None,
        cols: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The initial value of parameter `name`, on the CPU: whole, or (a rank's shard) its elements at the
        given rows and columns of the parameter seen as a matrix, as a [rows, cols] matrix. Each element's value
        depends on `init_seed`, the name and its position alone (project.model.initial_values). `out`: a
        [rows, cols] tensor to write the values into (a rank's shard) instead of a new one on the CPU.

        Normal(0, initial_std(name)); norm gains 1.
        """
        shape = self.get_parameter(name).shape  # the global shape, also for a sharded parameter
        std = self.initial_std(name)
        if std is None:
            n_rows, n_cols = matrix_shape(shape)
            size = (n_rows if rows is None else rows.numel(), n_cols if cols is None else cols.numel())
            values = torch.ones(size, device="cpu") if out is None else out.fill_(1.0)
        else:
            # Keyed by the name the family gives it, whatever wraps its block (activation checkpointing).
            values = normal_values(self.init_seed, own_name(name), shape, std, rows, cols, out)
        return values.view(shape) if rows is None and cols is None and out is None else values

    def initial_std(self, name: str) -> float | None:
        """The standard deviation of parameter `name`'s initial values, as its family's list of tensors says
        (project.model.spec: init_std, the residual projections init_std / sqrt(2 * n_layers) as in GPT-2); None for
        a norm's gain (ones)."""
        return self.tensor_specs[own_name(name)].std

    def rope(
        self, seq_len: int, device: torch.device, dtype: torch.dtype, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, head_dim] of the rotary angles of positions start .. start + T - 1 (`rope_at`)."""
        return self.rope_at(torch.arange(start, start + seq_len, device=device), dtype)

    def rope_at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, head_dim] of the rotary angles of `positions` [T], computed in float32 and then cast to
        `dtype`.

        The frequencies are recomputed on each call rather than kept in a buffer: mixed precision
        (bf16-true, FSDP's buffer_dtype) casts buffers to bfloat16, whose 8-bit mantissa puts the
        angles of late positions off by whole radians.
        """
        device = positions.device
        angles = torch.outer(positions.to(torch.float32), rope_frequencies(self.config, device))
        angles = self.channel_angles(angles)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    @staticmethod
    def channel_angles(angles: torch.Tensor) -> torch.Tensor:
        """Each channel's angle [T, head_dim] from each rotated pair's [T, head_dim / 2]: pair i is channels i and
        i + head_dim / 2 (rotate-half, HF Llama's layout; a family that pairs channels otherwise says so)."""
        return torch.cat((angles, angles), dim=-1)

    def attention_mask(
        self, seq_len: int, device: torch.device, document_ids: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> Any:
        """What the blocks' attention is masked by, for `seq_len` tokens (after the cached ones): None (causal), the
        documents' mask, or with a cache every cached position and causal among the new ones. A family whose layers
        attend differently gives what its attention's `positioned` reads."""
        if document_ids is not None:  # no T x T mask where FlexAttention trains (project.model.document_mask)
            return self.document_masking(document_ids)
        if cache is None:
            return None
        # is_causal would not do: it aligns the diagonal to the top left, so a single new query would see only the
        # first key.
        start = cache.length
        return torch.ones(seq_len, start + seq_len, dtype=torch.bool, device=device).tril(diagonal=start)

    def run_layers(
        self,
        h: torch.Tensor,
        layers,
        seq_len: int,
        document_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Hidden states through `layers` (some or all of this model's blocks, in order).

        `seq_len` is the sequence length of the tokens, which `h` may not show (sequence
        parallelism splits it). document_ids [B, T], optional: tokens attend only to earlier tokens
        of the same document (packed sequences); None gives plain causal attention. cache, optional
        (all of the model's layers only): the tokens follow the cached ones.
        """
        if cache is not None and document_ids is not None:
            raise ValueError("document_ids and a KV cache together are not supported.")
        start = cache.length if cache is not None else 0
        # The positions of the queries this rank holds: all of them, or a context-parallel rank's part.
        positions, _ = self.document_masking.queries(seq_len, h.device)
        cos, sin = self.rope_at(positions + start, h.dtype)
        mask = self.attention_mask(seq_len, h.device, document_ids, cache)
        if cache is None:
            for layer in layers:
                h = layer(h, cos, sin, mask)
        else:
            for layer, layer_cache in zip(layers, cache.layers, strict=True):
                h = layer(h, cos, sin, mask, layer_cache)
        return h

    def forward(
        self,
        tokens: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        targets: torch.Tensor | None = None,
        score_targets: bool = False,
    ) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, vocab_size]; document_ids as in `run_layers`. With `cache`
        (see KVCache) the tokens continue the cached ones, and their keys and values are added to it.
        With `targets` [B, T] (the next tokens), the mean next-token loss instead of the logits, which then
        never exist whole (`head_loss`): inside forward, so that a strategy's hooks on the model hold; with
        `score_targets` too, each target's log-probability and its position's highest (`head_log_probs`)."""
        T = tokens.shape[1]
        end = T + (cache.length if cache is not None else 0)
        if end > self.config.max_seq_len:
            raise ValueError(f"sequence length {end} exceeds model.max_seq_len={self.config.max_seq_len}.")
        if cache is not None and end > cache.max_len:
            raise ValueError(f"sequence length {end} exceeds the KV cache's max_len={cache.max_len}.")
        h = self.run_layers(self.tok_embeddings(tokens), self.layers.values(), T, document_ids, cache)
        if targets is not None:
            return (self.head_log_probs if score_targets else self.head_loss)(self.norm(h), targets)
        return self.output(self.norm(h))

    def head_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of the output head's logits of `hidden` [B, T, dim] (the final norm's output)
        against `targets` [B, T], `config.chunk_tokens` tokens at a time (project.model.loss)."""
        return chunked_cross_entropy(hidden, self.output, targets, self.config.chunk_tokens)

    def head_log_probs(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """[2, B, T]: each target's log-probability under the output head's logits of `hidden` (as `head_loss`
        takes it), and the highest at its position, chunked as the loss (project.model.loss)."""
        return chunked_target_log_probs(hidden, self.output, targets, self.config.chunk_tokens)


def mixtures_of(model: Llama) -> Sequence[Mixture]:
    """The mixtures of experts of the blocks `model` holds (FamilyHooks.mixtures); none where its family has none."""
    return [] if model.hooks is None else model.hooks.mixtures()
