"""The rollout engine core: requests -> scheduler -> slots over the KV cache -> finished sequences.

    add(requests)   each request = one prompt, n samples, a budget per sample, a randomness key
    step()          either admits waiting groups (prefill) or decodes the running rows for up to
                    `ring` tokens, then returns the sequences that finished

Admission: a group's samples take free slots together; its prompt is prefilled once, into the
first slot, and its KV copied to the others (a group larger than the cache is admitted in parts).
Prefill packs prompts up to `prefill_tokens` per forward and cuts longer prompts into chunks.
Decoding: every running row advances by one token per step, with no host involvement between the
host's looks every `ring` steps (CUDA graphs on the GPU); a row that stops or reaches its budget
frees its slot at the next look, and the next waiting group takes it (continuous batching).

Each token records the policy version that sampled it: weights can change between two steps
(in place, see BuiltinRollout.update_weights), and the rows continue with the new weights.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from slipstream.rollout.base import SamplingParams
from slipstream.rollout.decode_state import DecodeState, PendingRead
from slipstream.rollout.kv_cache import SlotCache
from slipstream.rollout.model_runner import ModelRunner
from slipstream.rollout.sampler import row_seed, sampling_mode


@dataclass(frozen=True)
class Request:
    """One prompt to sample `len(budgets)` completions of."""

    prompt: tuple[int, ...]
    budgets: tuple[int, ...]
    """max_new_tokens of each sample."""
    key: int
    """Randomness key: the prompt's position in the data stream (with the sampler seed and the sample index it
    decides every random draw of the sample)."""
    tag: object = None
    """Caller's handle, returned with the finished sequences."""


@dataclass
class Sequence:
    """One sample in flight: its slot, and the tokens, log-probs and policy versions sampled so far."""

    request: Request
    index: int
    seed: int
    slot: int = -1
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    planned: int = 0
    """Tokens sampled or on their way: len(tokens) plus this sequence's share of the rings not yet read."""

    @property
    def budget(self) -> int:
        return self.request.budgets[self.index]

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt)


@dataclass
class EngineStats:
    """Where generation time goes (seconds exclude graph capture; see ModelRunner.capture_s)."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_tokens: int = 0
    decode_steps: int = 0
    """Decode steps run (each advances every row of the batch by one token)."""
    decode_row_steps: int = 0
    """Sum over decode steps of the rows that were live at the step's start."""
    decode_device_s: float = 0.0
    """Device time of the decode steps replayed from CUDA graphs (CUDA events; 0 without graphs): decode_s less
    this is a lower bound on the time the device waited for the host (with `overlap`, an estimate: a queued
    ring also runs while the host is between two steps)."""


@dataclass
class _Ring:
    """Decode steps queued on the device whose outputs the host has not read yet."""

    rows: list[Sequence]
    """The sequence of each row, in the device state's order when the ring was queued."""
    steps: int
    version: int
    """Policy version of the weights the ring runs with (a weight sync is queued after it)."""
    outputs: PendingRead
    span: tuple | None
    """CUDA events around the ring's graph replays (ModelRunner.run_decode)."""


def pack_prefill(
    chunks: list[tuple[int, tuple[int, ...], int, int]], cache_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs of one prefill forward from (first cache row of the slot, prompt, start, end) per chunk: int64
    (3, T) rows token ids, positions, cache rows; int32 (3, n + 1) rows cu_seqlens_q, the slots' first cache
    rows then `cache_rows` (cu_seqlens_k: its last entry is never read, past every slot) and the lengths the
    chunks reach (the last entry unused). CPU tensors, built with tensor ops over the chunks rather than per token in Python: the
    device waits for this between two prefill forwards."""
    n = len(chunks)
    meta = torch.tensor([(end - start, start, base) for base, _, start, end in chunks], dtype=torch.int64)
    lengths, starts, bases = meta.unbind(1)
    ids = torch.tensor(list(itertools.chain.from_iterable(p[s:e] for _, p, s, e in chunks)), dtype=torch.int64)
    chunk = torch.repeat_interleave(torch.arange(n), lengths)
    cu_q = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu_q[1:])
    positions = torch.arange(len(ids)) - cu_q[chunk] + starts[chunk]
    seqs = torch.zeros(3, n + 1, dtype=torch.int64)
    seqs[0], seqs[1, :n], seqs[1, n], seqs[2, :n] = cu_q, bases, cache_rows, starts + lengths
    return torch.stack([ids, positions, bases[chunk] + positions]), seqs.to(torch.int32)


def decode_buckets(max_rows: int) -> list[int]:
    """Batch sizes that get a CUDA graph: fine steps where the batch is small (the long tail of an RL
    step), coarser ones above. A batch runs in the smallest bucket that holds it."""
    sizes = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64] + list(range(80, 257, 16)) + list(range(288, 4097, 32))
    return sorted({s for s in sizes if s < max_rows} | {max_rows})


class EngineCore:
    """Schedules sequences over a `SlotCache` and runs them with a `ModelRunner`."""

    def __init__(
        self, runner: ModelRunner, cache: SlotCache, seed: int, prefill_tokens: int, ring: int, overlap: bool = False
    ) -> None:
        self.runner, self.cache = runner, cache
        self.seed, self.prefill_tokens, self.ring = seed, prefill_tokens, ring
        self.overlap = overlap
        """Queue the next ring of decode steps before reading the last one (see `step`)."""
        self.state = DecodeState(cache.num_slots, ring, runner.device)
        self.buckets = decode_buckets(cache.num_slots)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._reload = True  # the running set changed since the device state was loaded from the host
        self._inflight: deque[_Ring] = deque()  # rings queued on the device, oldest first, not yet read
        self._device_rows: list[Sequence] = []  # the sequences of the device state's rows, in order
        self._half = 0  # the half of the output ring the next ring writes
        self._ready: list[Sequence] = []  # finished while reading rings outside `step` (drain)
        self.version = 0
        self.sampling = SamplingParams()
        self.mode = sampling_mode(self.sampling)
        self._stop_ids = torch.zeros(0, dtype=torch.int64)
        self.stats = EngineStats()

    # ------------------------------------------------------------------ requests
    def configure(self, sampling: SamplingParams, version: int) -> None:
        """Sampling parameters and policy version for the next steps (n and max_new_tokens are per request)."""
        self.sampling, self.mode, self.version = sampling, sampling_mode(sampling), version
        self._stop_ids = torch.tensor(sorted(set(sampling.stop_token_ids)), dtype=torch.int64)
        self.state.temperature.fill_(sampling.temperature if sampling.temperature > 0 else 1.0)
        self.state.top_p.fill_(sampling.top_p)

    def add(self, requests: list[Request]) -> None:
        for req in requests:
            if len(req.prompt) + max(req.budgets) > self.cache.slot_len:
                raise ValueError(
                    f"prompt ({len(req.prompt)}) + max_new_tokens ({max(req.budgets)}) does not fit a cache slot "
                    f"of {self.cache.slot_len} tokens"
                )
            for i in range(len(req.budgets)):
                self.waiting.append(Sequence(req, i, row_seed(self.seed, req.key, i)))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._ready)

    # ------------------------------------------------------------------ one scheduling step
    @torch.no_grad()
    def step(self) -> list[Sequence]:
        """Prefill newly admitted groups if any can start, else decode; returns the sequences that finished.

        A decode step reads one ring of up to `ring` decode steps: one wait for the device, so a step's wall
        time is its device time (graph captures inside it are counted apart, ModelRunner.capture_s). With
        `overlap` the step queues the next ring before it reads this one: the device decodes on while the
        host looks at the tokens. The next ring runs every row that has budget left, those that stopped in
        the ring being read included (their tokens are dropped), and leaves out the ones finished before. A
        prefill admitted then is queued behind that ring (the slots it takes are written after the ring's
        last use of them); its wait for the first tokens covers the ring too, which is then read at no cost
        (so with overlap, prefill_s holds the tail of a queued ring).
        """
        start, capture = time.perf_counter(), self.runner.capture_s
        if self._ready:
            finished, self._ready = self._ready, []
            return finished
        if self.waiting and self.cache.num_free:
            admitted = self._admit()
            if admitted:
                finished = self._prefill(admitted)
                while self._inflight:  # already run: the host knows every token before the rows load again
                    finished += self._read_ring()
                self.stats.prefill_s += time.perf_counter() - start - (self.runner.capture_s - capture)
                self.stats.prefill_tokens += sum(g[0].prompt_len for g in admitted)
                return finished
        if self.running:
            finished = self._decode()
            self.stats.decode_s += time.perf_counter() - start - (self.runner.capture_s - capture)
            return finished
        return []

    def drain(self) -> None:
        """Read every queued ring (the host then knows every sampled token); what finished, `step` returns."""
        while self._inflight:
            self._ready.extend(self._read_ring())

    def _admit(self) -> list[list[Sequence]]:
        """Groups (samples of one request, in order) that take free slots now, within the prefill budget."""
        groups: list[list[Sequence]] = []
        tokens = 0
        while self.waiting and self.cache.num_free:
            head = self.waiting[0]
            if groups and tokens + head.prompt_len > self.prefill_tokens:
                break
            need = sum(1 for _ in itertools.takewhile(lambda s: s.request is head.request, self.waiting))
            if self.cache.num_free < need <= self.cache.num_slots:
                break  # wait until the whole group fits: its prompt is then prefilled once
            group = []
            while (self.waiting and self.cache.num_free and self.waiting[0].request is head.request):
                seq = self.waiting.popleft()
                seq.slot = self.cache.allocate(1)[0]
                group.append(seq)
            groups.append(group)
            tokens += head.prompt_len
        return groups

    @torch.no_grad()
    def refresh_kv(self) -> None:
        """Recompute the keys and values of every running sequence (prompt + all but its last token) with the
        current weights, after a weight update: the next tokens then depend on the new weights only."""
        self.drain()
        if self.running:
            self._prefill_prompts([(s.slot, s.request.prompt + tuple(s.tokens[:-1])) for s in self.running])

    # ------------------------------------------------------------------ prefill
    def _prefill(self, groups: list[list[Sequence]]) -> list[Sequence]:
        """Prefill each group's prompt once (into its first sample's slot), copy it to the other slots,
        and sample every sample's first token from the prompt's last position."""
        last_hidden = self._prefill_prompts([(g[0].slot, g[0].request.prompt) for g in groups])
        sources, targets, longest = [], [], 0
        for g in groups:
            for seq in g[1:]:
                sources.append(g[0].slot)
                targets.append(seq.slot)
            longest = max(longest, g[0].prompt_len)
        self.cache.copy_prefix(sources, targets, longest)

        seqs = [seq for g in groups for seq in g]
        rows = torch.cat([last_hidden[i].expand(len(g), -1) for i, g in enumerate(groups)])
        dev = self.runner.device
        seeds = torch.tensor([s.seed for s in seqs], dtype=torch.int64, device=dev)
        first = torch.zeros(len(seqs), dtype=torch.int64, device=dev)
        tokens, logprobs = self.runner.sample_hidden(rows, self.state, seeds, first, self.mode)
        both = torch.stack([tokens.to(torch.float64), logprobs.to(torch.float64)]).cpu()  # one sync; both exact
        self.running.extend(seqs)
        self._reload = True
        return self._append(seqs, both[0].to(torch.int64)[:, None], both[1].to(torch.float32)[:, None])

    def _prefill_prompts(self, items: list[tuple[int, tuple[int, ...]]]) -> torch.Tensor:
        """Write the KV of each (slot, prompt) into the cache; returns the last position's hidden (P, H).

        The prompts' tokens are packed into forwards of at most `prefill_tokens`; a prompt that
        straddles two forwards continues in the second one, whose queries attend to the part the
        first one wrote (bottom-right causal attention over the slot)."""
        cache, dev = self.cache, self.runner.device
        last: list[torch.Tensor | None] = [None] * len(items)
        pending = [(i, slot, prompt, 0) for i, (slot, prompt) in enumerate(items)]
        while pending:
            budget, batch, rest = self.prefill_tokens, [], []
            for i, slot, prompt, start in pending:
                if budget <= 0:
                    rest.append((i, slot, prompt, start))
                    continue
                end = min(len(prompt), start + budget)
                batch.append((i, slot, prompt, start, end))
                budget -= end - start
                if end < len(prompt):
                    rest.append((i, slot, prompt, end))
            chunks = [(cache.base(slot), p, start, end) for _, slot, p, start, end in batch]
            tokens, seqs = pack_prefill(chunks, cache.k.shape[1])
            n = len(batch)
            # one tensor each, at storage offset 0 like the decode's (the compiled layers are not specialised again)
            ids, positions, rows, cu_q, cu_k, used = (
                t.to(dev, copy=True, non_blocking=True) for t in (*tokens, seqs[0], seqs[1], seqs[2, :n])
            )  # fmt: skip
            hidden = self.runner.forward(
                cache, ids, positions, rows, cu_q, cu_k, used, max(e - s for _, _, _, s, e in batch), causal=True
            )  # fmt: skip
            ends = itertools.accumulate(e - s for _, _, _, s, e in batch)
            for (i, _, prompt, _, end), row_end in zip(batch, ends):
                if end == len(prompt):
                    last[i] = hidden[row_end - 1]
            pending = rest
        return torch.stack(last)

    # ------------------------------------------------------------------ decode
    def _decode(self) -> list[Sequence]:
        """Read the oldest queued ring (queueing one first if none is), and with `overlap` queue the next
        before reading it."""
        if not self._inflight:
            self._launch()
        if self.overlap:
            self._launch()
        return self._read_ring()

    def _launch(self) -> None:
        """Queue one ring of decode steps on the device, for every row with budget left; no host sync."""
        if self._inflight:  # the device's rows have run on past what the host has read: move them there
            rows = [s for s in self._device_rows if s.finish_reason is None and s.planned < s.budget]
        else:
            rows = self.running
        if not rows:
            return
        bucket = self.buckets[bisect.bisect_left(self.buckets, len(rows))]
        if self._inflight:
            if self.runner.needs_capture(bucket, self.mode):
                # a capture synchronises the device: the queued rings finish first, as decode time
                self._inflight[-1].outputs.synchronize()
            if len(rows) != len(self._device_rows):
                at = {id(s): i for i, s in enumerate(self._device_rows)}
                self.state.compact([at[id(s)] for s in rows], bucket, self.cache)
        elif self._reload:
            self.state.load(
                {
                    "input_ids": [s.tokens[-1] for s in rows],
                    "positions": [s.prompt_len + len(s.tokens) - 1 for s in rows],
                    "bases": [self.cache.base(s.slot) for s in rows],
                    "seeds": [s.seed for s in rows],
                    "token_index": [len(s.tokens) for s in rows],
                },
                bucket,
                self.cache,
            )  # fmt: skip
        self._reload = False
        # no more steps than the longest remaining budget needs
        steps = min(self.ring, max(s.budget - s.planned for s in rows))
        half, self._half = self._half, 1 - self._half
        self.state.start_ring(half)
        span = self.runner.run_decode(self.cache, self.state, bucket, self.mode, steps)
        pending = self.state.read(len(rows), steps, half)
        for s in rows:
            s.planned = min(s.budget, s.planned + steps)
        self._inflight.append(_Ring(list(rows), steps, self.version, pending, span))
        self._device_rows = self._inflight[-1].rows
        self.stats.decode_steps += steps
        self.stats.decode_row_steps += steps * len(rows)

    def _read_ring(self) -> list[Sequence]:
        ring = self._inflight.popleft()
        tokens, logprobs = ring.outputs.wait()
        self._count_device_time(ring)
        finished = self._append(ring.rows, tokens, logprobs, ring.version)
        if not self.running:
            # the rings still queued hold only rows that stopped (each ring's rows are a subset of the one before,
            # and every running row is in all of them): nothing to read, but the engine is idle only once they
            # have run (the cache and the state may be freed or handed to another stream next)
            while self._inflight:
                ring = self._inflight.popleft()
                ring.outputs.synchronize()
                self._count_device_time(ring)
        return finished

    def _count_device_time(self, ring: _Ring) -> None:
        if ring.span is not None:
            self.stats.decode_device_s += ring.span[0].elapsed_time(ring.span[1]) / 1e3

    def _append(
        self, seqs: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor, version: int | None = None
    ) -> list[Sequence]:
        """Append each sequence's new tokens (row i of the CPU tensors (len(seqs), k): int64 tokens, fp32
        log-probs, sampled by policy `version`, the current one by default) up to and including a stop token,
        or up to its budget; release finished slots. Sequences finished before take nothing.

        The host works on this once per ring of k decode steps (while the device waits, unless the next ring
        is queued): the stop search is one vectorised pass and each sequence takes its tokens as one slice."""
        version = self.version if version is None else version
        k = tokens.shape[1]
        hits = torch.isin(tokens, self._stop_ids)  # all False without stop tokens
        first_stop = torch.where(hits.any(1), hits.to(torch.int8).argmax(1), k).tolist()
        token_rows, logprob_rows = tokens.tolist(), logprobs.tolist()
        finished = []
        for seq, toks, lps, stop_at in zip(seqs, token_rows, logprob_rows, first_stop):
            if seq.finish_reason:
                continue
            room = seq.budget - len(seq.tokens)
            n = min(k, room, stop_at + 1)
            seq.tokens.extend(toks[:n])
            seq.logprobs.extend(lps[:n])
            seq.versions.extend([version] * n)
            seq.planned = max(seq.planned, len(seq.tokens))
            if stop_at < n:  # the stop token is within the budget (it wins over the budget at the same token)
                seq.finish_reason = "stop"
            elif len(seq.tokens) >= seq.budget:
                seq.finish_reason = "length"
            if seq.finish_reason:
                finished.append(seq)
        if finished:
            done = {id(s) for s in finished}
            self.running = [s for s in self.running if id(s) not in done]
            self.cache.release([s.slot for s in finished])
            self._reload = True
        return finished
