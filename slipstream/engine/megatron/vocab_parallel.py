"""Per-token log-prob and entropy over a vocabulary split across tensor-parallel ranks.

Each TP rank holds rows [vocab_start, vocab_start + V_r) of the LM-head weight (V_r, H) and the
full hidden states h (T, H). For z = h W^T / tau, the softmax statistics are combined with two
small all-reduces per token chunk (never a gather of the vocabulary):

    m        = max over ranks of the local row max                (T,)   all-reduce MAX
    s, zt, q = local sum exp(z - m), target logit (0 off-shard),
               sum exp(z - m) * z                                 (T, 3) all-reduce SUM
    logprob  = zt - (m + log s),  entropy = (m + log s) - q / s

The backward recomputes each chunk's local logits: with p = softmax(z) restricted to this
shard, d logprob / dz = onehot(target) - p and d entropy / dz = -p (z - sum_v p_v z_v). The
gradient of the weight shard is local; the gradient of h is a partial sum over the shard's
vocabulary, so it is all-reduced over the TP group (h is replicated on every TP rank).

Pure torch.distributed: a process group in, no megatron import (tested with gloo on the CPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slipstream.ops.logprobs import addmm_fp32

_DEFAULT_CHUNK_ROWS = 4096


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """(rows, V_r) fp32 logits of one row chunk (matmul in the input dtype, fp32 accumulate)."""
    return (h @ weight.T).float() / temperature


def _local_targets(targets: torch.Tensor, vocab_start: int, vocab_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index into this shard clamped into range, whether the target lives on this shard)."""
    local = targets - vocab_start
    on_shard = (local >= 0) & (local < vocab_local)
    return local.clamp(0, vocab_local - 1), on_shard


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start, temperature, with_entropy, chunk_rows, group):
        num_tokens, vocab_local = hidden.shape[0], weight.shape[0]
        logprobs = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprobs)
        lse = torch.empty_like(logprobs)
        mean_z = torch.empty_like(logprobs)  # sum_v p_v z_v, needed by the entropy gradient
        for start in range(0, num_tokens, chunk_rows):
            rows = slice(start, min(start + chunk_rows, num_tokens))
            z = _chunk_logits(hidden[rows], weight, temperature)
            m = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group)
            e = torch.exp(z - m[:, None])
            idx, on_shard = _local_targets(targets[rows], vocab_start, vocab_local)
            z_target = z.gather(1, idx[:, None]).squeeze(1) * on_shard
            stats = torch.stack([e.sum(-1), z_target, (e * z).sum(-1)], dim=1)
            s, z_target, q = _all_reduce(stats, dist.ReduceOp.SUM, group).unbind(1)
            lse[rows] = m + torch.log(s)
            logprobs[rows] = z_target - lse[rows]
            mean_z[rows] = q / s
            entropy[rows] = lse[rows] - mean_z[rows]
        ctx.save_for_backward(hidden, weight, targets, lse, mean_z)
        ctx.args = (vocab_start, temperature, chunk_rows, group)
        return logprobs, entropy if with_entropy else None

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, lse, mean_z = ctx.saved_tensors
        vocab_start, temperature, chunk_rows, group = ctx.args
        vocab_local = weight.shape[0]
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, min(start + chunk_rows, hidden.shape[0]))
            z = _chunk_logits(hidden[rows], weight, temperature)
            p = torch.exp(z - lse[rows, None])
            grad_z = torch.zeros_like(z)
            if grad_logprobs is not None:
                g = grad_logprobs[rows].float()
                idx, on_shard = _local_targets(targets[rows], vocab_start, vocab_local)
                grad_z -= p * g[:, None]
                grad_z.scatter_add_(1, idx[:, None], (g * on_shard)[:, None])
            if grad_entropy is not None:
                grad_z -= grad_entropy[rows].float()[:, None] * p * (z - mean_z[rows, None])
            grad_z = grad_z / temperature
            grad_hidden[rows] = (grad_z.to(weight.dtype) @ weight).to(hidden.dtype)
            # bf16 GEMM with fp32 accumulation into grad_weight (as the TP=1 fused op does), not an fp32 GEMM
            addmm_fp32(grad_weight, grad_z.T.to(hidden.dtype), hidden[rows])
        # h feeds every rank's vocabulary shard: its gradient is the sum of the shards' parts.
        _all_reduce(grad_hidden, dist.ReduceOp.SUM, group)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None, None


def vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    group: dist.ProcessGroup | None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 log-probs (T,) of `targets` (and entropy) under softmax(hidden @ W.T / temperature).

    hidden (T, H) is the same on every rank of `group`; weight (V_r, H) is this rank's vocab
    shard starting at `vocab_start`; targets (T,) are global vocabulary ids. Differentiable
    w.r.t. hidden and weight. `chunk_size` rows are processed at a time (a (rows, V_r) fp32
    tile is the working memory).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden (T, H) and weight (V_r, H), got {tuple(hidden.shape)}, {tuple(weight.shape)}"
        )
    chunk_rows = max(1, chunk_size or _DEFAULT_CHUNK_ROWS)
    return _VocabParallelLogprobs.apply(
        hidden, weight, targets, vocab_start, temperature, with_entropy, chunk_rows, group
    )
