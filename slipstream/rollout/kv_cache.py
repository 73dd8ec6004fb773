"""The rollout's KV cache: a fixed number of slots, each a contiguous region of `slot_len` tokens.

Layout: k, v (layers, (num_slots + 1) * slot_len, kv_heads, head_dim). Slot s holds one sequence
at rows [s * slot_len, s * slot_len + length) of every layer; the extra last slot is scratch,
written and read only by the padding rows of a decode batch.

Why slots and not paged blocks: torch's FlashAttention forward takes ragged lengths over a
flattened cache (`seqused_k`, ops/attention.py:cache_attention) but, on the torch versions we
support, no block table. Slots cost memory (each reserves the longest prompt + budget of the
current call), which on an RL step of one prompt length and one budget is what a block cache
would hold at its peak anyway; admission is then simply "a free slot".
"""

from __future__ import annotations

import torch

from slipstream.models.config import ModelConfig

SLOT_ROUNDING = 256
"""Slot lengths are rounded up to a multiple of this, so nearby lengths reuse one cache."""


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of keys + values of one token over every layer."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


def plan_slots(
    cfg: ModelConfig,
    slot_len: int,
    max_slots: int,
    device: torch.device,
    dtype: torch.dtype,
    memory_fraction: float,
    replaced_bytes: int = 0,
) -> int:
    """How many slots of `slot_len` tokens to allocate: at most `max_slots`, within the memory budget.

    On CUDA the budget is `memory_fraction` of the device memory free right now plus the cache this one
    replaces (`replaced_bytes`, freed by the caller: torch's allocator still holds it, unused, and returns it
    to the device when the new cache needs the room; other memory it holds unused, the trainer's included,
    stays out of the budget); on the CPU the slots asked for are allocated.
    Raises ValueError naming the settings when not even one fits.
    """
    if device.type != "cuda":
        return max_slots
    per_slot = slot_len * kv_bytes_per_token(cfg, dtype)
    free, _ = torch.cuda.mem_get_info(device)
    held_unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    free += min(replaced_bytes, held_unused)
    fit = int(free * memory_fraction) // per_slot - 1  # one slot's worth is the scratch slot
    if fit < 1:
        raise ValueError(
            f"the rollout KV cache cannot hold even one sequence of {slot_len} tokens ({per_slot / 2**30:.2f} GiB) "
            f"in rollout.gpu_memory_fraction={memory_fraction} of the {free / 2**30:.1f} GiB free: raise "
            "rollout.gpu_memory_fraction, or lower rollout.max_new_tokens or data.max_prompt_length"
        )
    return min(max_slots, fit)


class SlotCache:
    """Keys and values of `num_slots` sequences of up to `slot_len` tokens, plus a free list."""

    def __init__(self, cfg: ModelConfig, num_slots: int, slot_len: int, device: torch.device, dtype: torch.dtype):
        if num_slots < 1 or slot_len < 1:
            raise ValueError(f"need at least one slot of one token, got {num_slots} x {slot_len}")
        self.num_slots, self.slot_len = num_slots, slot_len
        shape = (cfg.num_layers, (num_slots + 1) * slot_len, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def base(self, slot: int) -> int:
        """First cache row of `slot`."""
        return slot * self.slot_len

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"{n} slots asked for, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, slots: list[int]) -> None:
        self._free.extend(slots)

    def copy_prefix(self, sources: list[int], targets: list[int], length: int) -> None:
        """Copy the first `length` tokens of slot sources[i] into slot targets[i] (every layer)."""
        if not targets:
            return
        idx = lambda slots: torch.tensor(slots, device=self.k.device)  # noqa: E731
        for cache in (self.k, self.v):
            view = cache.view(cache.shape[0], self.num_slots + 1, self.slot_len, *cache.shape[2:])
            view[:, idx(targets), :length] = view[:, idx(sources), :length]
