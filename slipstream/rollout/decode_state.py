"""The rollout's decode state on the device: the rows' inputs of the next decode step and the output ring.

A decode step (`ModelRunner.decode_step`) reads each row's next input token, position, cache slot, sampling
seed and response index from these buffers and writes the advanced values back, so k steps replay without
the host; their tokens and log-probs land in an output ring that the host reads after the k steps
(`read`: a pinned copy and an event on CUDA, `PendingRead`). Rows are filled from the host (`load`) or
moved on the device (`compact`) when some leave while a ring is still queued.
"""

from __future__ import annotations

import torch

from slipstream.rollout.kv_cache import SlotCache


class DecodeState:
    """Device buffers of the rows being decoded: inputs of the next step and the output ring.

    Row r decodes the sequence in cache slot `bases[r] / slot_len`: its next input token, that
    token's position (= its row in the slot), its 32-bit sampling seed and the index of the
    response token being sampled. `out_tokens` / `out_logprobs` (2k, rows) take one row per step, at
    `step`: a ring of up to k steps starts at row 0 or k (`start_ring`), so the host can read one ring's
    outputs while the next ring writes the other half.
    """

    def __init__(self, max_rows: int, ring: int, device: torch.device) -> None:
        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.max_rows, self.ring = max_rows, ring
        self.input_ids, self.positions, self.bases = zeros(max_rows), zeros(max_rows), zeros(max_rows)
        self.seeds, self.token_index = zeros(max_rows), zeros(max_rows)
        self.seqused = zeros(max_rows, dtype=torch.int32)
        self.cu_q = torch.arange(max_rows + 1, dtype=torch.int32, device=device)  # one query per row
        self.cu_k = zeros(max_rows + 1, dtype=torch.int32)  # [:rows] = bases; the last entry is never read
        self.out_tokens = zeros(2 * ring, max_rows)
        self.out_logprobs = zeros(2 * ring, max_rows, dtype=torch.float32)
        self.step = zeros(1)
        self.temperature = torch.ones((), dtype=torch.float32, device=device)
        self.top_p = torch.ones((), dtype=torch.float32, device=device)

    _ROW_FIELDS = ("input_ids", "positions", "bases", "seeds", "token_index")

    def load(self, rows: dict[str, list[int]], bucket: int, cache: SlotCache) -> None:
        """Fill the first len(rows) rows from host lists; rows up to `bucket` point at the scratch slot."""
        n = len(rows["bases"])
        pad = bucket - n
        scratch = cache.base(cache.scratch_slot)
        host = {name: rows[name] + [scratch if name == "bases" else 0] * pad for name in self._ROW_FIELDS}
        packed = torch.tensor([host[name] for name in self._ROW_FIELDS], dtype=torch.int64)
        packed = packed.to(self.input_ids.device, non_blocking=True)
        for i, name in enumerate(self._ROW_FIELDS):
            getattr(self, name)[:bucket].copy_(packed[i])
        self.cu_k[:bucket].copy_(packed[self._ROW_FIELDS.index("bases")])

    def compact(self, keep: list[int], bucket: int, cache: SlotCache) -> None:
        """Rows keep[i] move to row i, on the device (the host need not know their latest tokens: a ring still
        running may have advanced them); rows len(keep) up to `bucket` point at the scratch slot."""
        index = torch.tensor(keep, dtype=torch.int64)
        if self.input_ids.device.type == "cuda":
            index = index.pin_memory()
        index = index.to(self.input_ids.device, non_blocking=True)
        n = len(keep)
        for name in self._ROW_FIELDS:
            field = getattr(self, name)
            field[:n] = field.index_select(0, index)
        self.cu_k[:n] = self.bases[:n]
        self._pad(cache, n, bucket)

    def _pad(self, cache: SlotCache, start: int, end: int) -> None:
        for name in self._ROW_FIELDS:
            getattr(self, name)[start:end].zero_()
        self.bases[start:end].fill_(cache.base(cache.scratch_slot))
        self.cu_k[start:end].fill_(cache.base(cache.scratch_slot))

    def start_ring(self, half: int) -> None:
        """The next decode step writes its outputs at row 0 (half 0) or k (half 1) of the output ring."""
        self.step.fill_(half * self.ring)

    def point_at_scratch(self, cache: SlotCache, rows: int) -> None:
        self._pad(cache, 0, rows)
        self.step.zero_()

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name).clone() for name in (*self._ROW_FIELDS, "cu_k", "step")}

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        for name, value in saved.items():
            getattr(self, name).copy_(value)

    def read(self, rows: int, steps: int, half: int) -> "PendingRead":
        """Queue the copy to the host of the first `rows` rows' `steps` outputs in `half` of the ring (after the
        work queued so far); `wait()` on the result returns them.

        Tokens and the bits of the fp32 log-probs travel in one int32 tensor: one copy, one wait.
        """
        at = slice(half * self.ring, half * self.ring + steps)
        both = torch.stack([self.out_tokens[at, :rows].to(torch.int32), self.out_logprobs[at, :rows].view(torch.int32)])
        if both.device.type != "cuda":
            return PendingRead(both, None)
        host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
        host.copy_(both, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(both.device))
        return PendingRead(host, done)


class PendingRead:
    """A ring's outputs on their way to the host (a pinned buffer and the event of its copy)."""

    def __init__(self, host: torch.Tensor, done: torch.cuda.Event | None) -> None:
        self.host, self.done = host, done

    def synchronize(self) -> None:
        """Wait for the copy (and the work queued before it), not for later work."""
        if self.done is not None:
            self.done.synchronize()

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """CPU tensors (rows, steps): tokens int64, log-probs fp32, once the copy is done."""
        self.synchronize()
        return self.host[0].t().to(torch.int64), self.host[1].view(torch.float32).t()
