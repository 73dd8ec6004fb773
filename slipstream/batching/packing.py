"""Build `PackedBatch`es from samples, cut them into sub-batches and put results back.

Alignment (see records.py): position t predicts `targets[t]`, the next token of the same
sequence. For a sample with P prompt tokens and R response tokens the response tokens are
predicted by positions P-1 .. P+R-2, so those positions carry the loss mask, the advantage
and the behaviour log-prob of the token they predict.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from slipstream.batching.records import MicroBatchPlan, PackedBatch, Sample

PAD_SAMPLE_ID = -1
"""`sample_ids` entry of the dummy sequence appended by `pad_to_multiple`."""

# Optional per-token arrays that follow their tokens through select / pad.
_OPTIONAL_PER_TOKEN = ("old_logprobs", "ref_logprobs", "behav_logprobs", "fresh_mask")


def _cu_seqlens(lens: Sequence[int]) -> torch.Tensor:
    """Cumulative lengths starting at 0, int32 as varlen attention kernels expect."""
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
    if len(lens):
        cu[1:] = torch.cumsum(torch.as_tensor(list(lens), dtype=torch.int64), 0)
    return cu.to(torch.int32)


def _layout(lens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cu_seqlens, seq_index, position_ids) of sequences of the given lengths packed back to back."""
    cu = _cu_seqlens(lens)
    lens_t = torch.as_tensor(list(lens), dtype=torch.int64)
    seq_index = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int64), lens_t)
    total = int(cu[-1])
    # Position within its own sequence: global position minus the start of that sequence.
    position_ids = torch.arange(total, dtype=torch.int64) - cu[:-1].to(torch.int64)[seq_index]
    return cu, seq_index, position_ids


def pack_samples(
    samples: Sequence[Sample],
    seq_advantages: torch.Tensor | None = None,
    indices: Sequence[int] | None = None,
    fresh_version: int | None = None,
) -> PackedBatch:
    """Concatenate prompt + response of every sample into one flat `PackedBatch` (CPU tensors).

    `seq_advantages` (n,) is broadcast to the loss-masked positions of each sequence (zeros
    when None). `indices` becomes `sample_ids` (default 0..n-1). With `fresh_version`, `fresh_mask`
    marks the response tokens sampled by that policy version.
    """
    n = len(samples)
    if indices is None:
        indices = range(n)
    if len(indices) != n:
        raise ValueError(f"got {len(indices)} indices for {n} samples")
    if seq_advantages is None:
        seq_advantages = torch.zeros(n, dtype=torch.float32)
    seq_advantages = torch.as_tensor(seq_advantages).detach().to("cpu", torch.float32)
    if seq_advantages.shape != (n,):
        raise ValueError(
            f"seq_advantages must have shape ({n},), one value per sample; got {tuple(seq_advantages.shape)}"
        )

    for i, s in enumerate(samples):
        if len(s.prompt_ids) == 0:
            # The first response token must be predicted from some position, so at least
            # one prompt token (e.g. BOS) is required.
            raise ValueError(f"sample {i} has an empty prompt; need at least one prompt token (e.g. BOS)")
    lens = [s.num_tokens for s in samples]
    prompt_lens = [len(s.prompt_ids) for s in samples]
    total = sum(lens)
    # np.fromiter over the chained tuples is several times faster than torch.tensor(list)
    # at a million tokens.
    chained = itertools.chain.from_iterable(part for s in samples for part in (s.prompt_ids, s.response_ids))
    input_ids = torch.from_numpy(np.fromiter(chained, dtype=np.int64, count=total))
    behav = np.fromiter(itertools.chain.from_iterable(s.behav_logprobs for s in samples), dtype=np.float32)

    cu, seq_index, position_ids = _layout(lens)

    # targets[t] = input_ids[t+1] inside a sequence; the last position of a sequence has no target.
    targets = torch.zeros(total, dtype=torch.int64)
    if total:
        targets[:-1] = input_ids[1:]
        targets[cu[1:].to(torch.int64) - 1] = 0

    # Loss positions are P-1 .. L-2 of each sequence: exactly R of them (none for R == 0).
    p_tok = torch.as_tensor(prompt_lens, dtype=torch.int64)[seq_index]
    l_tok = torch.as_tensor(lens, dtype=torch.int64)[seq_index]
    loss_mask = (position_ids >= p_tok - 1) & (position_ids <= l_tok - 2)
    assert int(loss_mask.sum()) == behav.size

    advantages = torch.where(loss_mask, seq_advantages[seq_index], torch.zeros(()))
    behav_logprobs = torch.zeros(total, dtype=torch.float32)
    # Masked positions enumerate response tokens in sequence order, matching `behav`.
    behav_logprobs[loss_mask] = torch.from_numpy(behav)
    fresh_mask = None
    if fresh_version is not None:
        versions = itertools.chain.from_iterable(
            s.token_versions or (s.version,) * len(s.response_ids) for s in samples
        )  # fmt: skip
        fresh_mask = torch.zeros(total, dtype=torch.bool)
        fresh_mask[loss_mask] = torch.from_numpy(np.fromiter(versions, dtype=np.int64, count=behav.size) == fresh_version)

    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        cu_seqlens=cu,
        max_seqlen=max(lens, default=0),
        targets=targets,
        loss_mask=loss_mask,
        seq_index=seq_index,
        advantages=advantages.to(torch.float32),
        old_logprobs=None,
        ref_logprobs=None,
        behav_logprobs=behav_logprobs,
        fresh_mask=fresh_mask,
        sample_ids=tuple(int(i) for i in indices),
    )


def token_index(batch: PackedBatch, seq_ids: Sequence[int]) -> torch.Tensor:
    """Flat positions (int64, on the batch's device) of the tokens of `seq_ids`, in that order."""
    n = batch.num_seqs
    seq_ids = [int(i) for i in seq_ids]
    if any(i < 0 or i >= n for i in seq_ids):
        raise ValueError(f"sequence ids must lie in [0, {n}); got {seq_ids}")
    if len(set(seq_ids)) != len(seq_ids):
        raise ValueError(f"sequence ids must be distinct; got {seq_ids}")
    cu = batch.cu_seqlens.to("cpu", torch.int64)
    starts = cu[seq_ids]
    lens = cu[[i + 1 for i in seq_ids]] - starts
    # arange(total) minus each token's segment offset, plus its segment's start in the batch.
    seg = torch.repeat_interleave(torch.arange(len(seq_ids)), lens)
    seg_offsets = torch.cumsum(lens, 0) - lens
    idx = torch.arange(int(lens.sum())) - seg_offsets[seg] + starts[seg]
    return idx.to(batch.input_ids.device)


def select(batch: PackedBatch, seq_ids: Sequence[int]) -> PackedBatch:
    """Sub-batch of the sequences `seq_ids` (in that order), repacked; per-token arrays follow."""
    idx = token_index(batch, seq_ids)
    seq_ids = [int(i) for i in seq_ids]
    all_lens = batch.seq_lens()
    lens = [all_lens[i] for i in seq_ids]
    cu, seq_index, position_ids = _layout(lens)
    device = batch.input_ids.device
    sample_ids = batch.sample_ids or tuple(range(batch.num_seqs))
    optional = {
        name: (getattr(batch, name)[idx] if getattr(batch, name) is not None else None)
        for name in _OPTIONAL_PER_TOKEN
    }
    return PackedBatch(
        input_ids=batch.input_ids[idx],
        position_ids=position_ids.to(device),
        cu_seqlens=cu.to(device),
        max_seqlen=max(lens, default=0),
        targets=batch.targets[idx],
        loss_mask=batch.loss_mask[idx],
        seq_index=seq_index.to(device),
        advantages=batch.advantages[idx],
        sample_ids=tuple(sample_ids[i] for i in seq_ids),
        **optional,
    )


def micro_batches(batch: PackedBatch, plan: MicroBatchPlan, rank: int = 0) -> list[PackedBatch]:
    """The micro-batches of `rank` under `plan`, in the plan's order (indices are sequence ids)."""
    if not 0 <= rank < plan.num_ranks:
        raise ValueError(f"rank {rank} out of range for a plan over {plan.num_ranks} ranks")
    return [select(batch, ids) for ids in plan.assignments[rank]]


def _seq_ids_in(batch: PackedBatch, mb: PackedBatch) -> list[int]:
    """Sequence ids in `batch` of the real sequences of micro-batch `mb`, matched by `sample_ids`."""
    position = {sid: i for i, sid in enumerate(batch.sample_ids)}
    if len(position) != batch.num_seqs or PAD_SAMPLE_ID in position:
        raise ValueError("matching micro-batches by sample_ids needs distinct sample_ids in the full batch")
    real = [sid for sid in mb.sample_ids if sid != PAD_SAMPLE_ID]
    missing = [sid for sid in real if sid not in position]
    if missing:
        raise ValueError(f"micro-batch sample_ids {missing} are not in the full batch")
    ids = [position[sid] for sid in real]
    full_lens, mb_lens = batch.seq_lens(), mb.seq_lens()
    if [full_lens[i] for i in ids] != mb_lens[: len(ids)]:
        raise ValueError("micro-batch sequence lengths do not match the full batch")
    return ids


def scatter_per_token(
    values_per_mb: Sequence[torch.Tensor],
    mbs: Sequence[PackedBatch | Sequence[int]],
    batch: PackedBatch,
) -> torch.Tensor:
    """Put per-token values computed on micro-batches back in `batch` order.

    Each entry of `mbs` is either a micro-batch made by `select(batch, ...)` (possibly padded
    by `pad_to_multiple`; matched through `sample_ids`) or the list of sequence ids it was
    selected with. values_per_mb[j] has shape (T_j, ...); trailing padding positions are
    dropped. Positions of sequences no micro-batch covers are 0. Returns (T, ...) on the
    device of the values.
    """
    if len(values_per_mb) != len(mbs):
        raise ValueError(f"{len(values_per_mb)} value tensors for {len(mbs)} micro-batches")
    if not values_per_mb:
        raise ValueError("need at least one micro-batch of values")
    first = values_per_mb[0]
    out = first.new_zeros((batch.num_tokens, *first.shape[1:]))
    covered: set[int] = set()
    for values, mb in zip(values_per_mb, mbs):
        ids = _seq_ids_in(batch, mb) if isinstance(mb, PackedBatch) else [int(i) for i in mb]
        if covered.intersection(ids):
            raise ValueError(f"sequences {sorted(covered.intersection(ids))} appear in two micro-batches")
        covered.update(ids)
        idx = token_index(batch, ids).to(values.device)
        if values.shape[0] < idx.numel():
            raise ValueError(f"micro-batch values have {values.shape[0]} positions, need {idx.numel()}")
        out[idx] = values[: idx.numel()].to(out.dtype)
    return out


def pad_to_multiple(batch: PackedBatch, multiple: int, pad_token_id: int = 0) -> PackedBatch:
    """Append one dummy sequence (no loss) so the token count is a multiple of `multiple`.

    The dummy sequence has its own `cu_seqlens` segment, so real tokens never attend to it,
    and `sample_ids` entry PAD_SAMPLE_ID (-1); count sequences from `sample_ids`, not `num_seqs`,
    when normalising losses. The batch is returned unchanged when already aligned.
    """
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    num_pad = (-batch.num_tokens) % multiple
    if num_pad == 0:
        return batch
    device = batch.input_ids.device

    def extend(t: torch.Tensor, fill) -> torch.Tensor:
        return torch.cat([t, torch.full((num_pad,), fill, dtype=t.dtype, device=device)])

    cu = torch.cat([batch.cu_seqlens, (batch.cu_seqlens[-1:] + num_pad)])
    optional = {
        name: (extend(getattr(batch, name), 0) if getattr(batch, name) is not None else None)
        for name in _OPTIONAL_PER_TOKEN
    }
    sample_ids = batch.sample_ids or tuple(range(batch.num_seqs))
    return PackedBatch(
        input_ids=extend(batch.input_ids, pad_token_id),
        position_ids=torch.cat([batch.position_ids, torch.arange(num_pad, device=device)]),
        cu_seqlens=cu,
        max_seqlen=max(batch.max_seqlen, num_pad),
        targets=extend(batch.targets, 0),
        loss_mask=extend(batch.loss_mask, False),
        seq_index=extend(batch.seq_index, batch.num_seqs),
        advantages=extend(batch.advantages, 0.0),
        sample_ids=(*sample_ids, PAD_SAMPLE_ID),
        **optional,
    )
