"""Builtin rollout engine: the native `Transformer` over a slot KV cache, in the trainer's process.

    generate(prompts, sampling, keys, budgets)   continuous batching over the engine core (core.py)
    submit(...) / step() / has_work              the same, streamed: requests join while others run
    update_weights(named_tensors, version)       in-place copies: the CUDA graphs stay valid
    sleep()                                      free the KV cache and the weights (the next
                                                 update_weights brings weights back)
    state_dict() / load_state_dict(state)        policy version and key counter, for a resume

It is both a `RolloutEngine` and a `StreamingRolloutEngine` (rollout/base.py).

On the CPU it runs eagerly in fp32 (tests, the demo); on CUDA it decodes from CUDA graphs with
compiled layer halves (rollout.compile, rollout.cuda_graphs). Compilation and graph capture
happen once, on first use at a shape, and are reported as `startup_s`, apart from generation.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Iterable

import torch

from slipstream.batching.records import Sample
from slipstream.models.config import ModelConfig
from slipstream.models.hf import load_hf_weights_into
from slipstream.models.transformer import Transformer
from slipstream.ops.decode_attention import PROGRAMS_PER_SM
from slipstream.rollout.base import SamplingParams
from slipstream.rollout.core import EngineCore, Request
from slipstream.rollout.kv_cache import SLOT_ROUNDING, SlotCache, plan_slots
from slipstream.rollout.model_runner import ModelRunner, allocate_parameters, drop_parameters


class BuiltinRollout:
    """In-process RolloutEngine and StreamingRolloutEngine owning its own `Transformer`."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 256,
        seed: int = 0,
        *,
        compile: bool | None = None,
        cuda_graphs: bool | None = None,
        gpu_memory_fraction: float = 0.5,
        prefill_tokens: int = 16384,
        decode_steps_per_sync: int = 16,
        decode_attention: str = "triton",
        on_weight_update: str = "keep",
        overlap_decode: bool = True,
        layer_kernels: bool = True,
        fused_lm_head: bool = False,
        decode_launch: str | None = None,
        decode_programs_per_sm: int = PROGRAMS_PER_SM,
    ) -> None:
        """The keyword settings are the rollout section's fields of the same names (config/schema.py)."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.cfg = model_cfg
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.seed = seed
        self.memory_fraction = gpu_memory_fraction
        self.prefill_tokens = prefill_tokens
        self.ring = decode_steps_per_sync
        self.overlap_decode = overlap_decode
        self.version = 0
        if on_weight_update not in ("keep", "reprefill"):
            raise ValueError(f"on_weight_update must be keep or reprefill, got {on_weight_update!r}")
        self.on_weight_update = on_weight_update
        self.model = Transformer(model_cfg).to(device=self.device, dtype=dtype)
        self.model.init_weights(seed)
        self.model.eval().requires_grad_(False)
        self.runner = ModelRunner(
            self.model,
            compile=on_gpu if compile is None else compile,
            cuda_graphs=on_gpu if cuda_graphs is None else cuda_graphs,
            decode_attention=decode_attention,
            layer_kernels=layer_kernels,
            fused_lm_head=fused_lm_head,
            decode_launch=decode_launch,
            decode_programs_per_sm=decode_programs_per_sm,
        )
        self.cache: SlotCache | None = None
        self.core: EngineCore | None = None
        self._next_key = 0  # keys of calls that pass none: consecutive, saved in state_dict
        self._asleep = False
        self._dropped: dict[str, torch.Size] | None = None  # parameter shapes while sleep has freed them
        self.startup_s = 0.0  # compile + graph capture time, measured around first uses

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy HF-named tensors into the existing parameter storage; every parameter must be provided.

        In place, so compiled code and captured graphs keep pointing at the right memory; rows in
        flight continue with the new weights and tag their next tokens with `version`: with their
        cached keys / values ("keep", the prefix as the old weights saw it) or with the prefix
        prefilled again by the new weights ("reprefill").
        """
        if self._asleep:
            self.wake()
        updated = load_hf_weights_into(self.model, named_tensors)
        missing = sorted(set(self.model.state_dict()) - updated)
        if missing:
            raise ValueError(f"update_weights left {len(missing)} weights unset, e.g. {missing[:4]}")
        self._dropped = None
        self.version = int(version)
        if self.core is not None:
            self.core.version = self.version
            if self.on_weight_update == "reprefill":
                self.core.refresh_kv()

    def state_dict(self) -> dict:
        """Policy version and the key counter of calls without keys (sampling itself is stateless)."""
        return {"version": self.version, "next_key": self._next_key, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.version = int(state["version"])
        self._next_key = int(state.get("next_key", 0))

    def sleep(self) -> None:
        """Free the KV cache and the weights, so the accelerator memory is free for training.

        The weights are dropped, not moved to the CPU: a colocated engine sleeps only until the
        trainer's next `update_weights`, which overwrites every one of them, so keeping them would
        cost a device -> host and a host -> device copy of the whole model for nothing. The captured
        graphs point at the freed memory and are dropped; the next generation after the update
        recaptures them (the compiled code is kept)."""
        if self._asleep:
            return
        self.core = self.cache = None
        self.runner.drop_graphs()
        self.runner.fused = []  # the fused q/k/v and gate/up storages
        self._dropped = drop_parameters(self.model)
        self._asleep = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """Storage for the weights again, uninitialised: only `update_weights` calls it, and fills every
        weight before the engine generates (generating in between raises)."""
        if self._asleep:
            self.runner.refuse(self._dropped)  # the fused q/k/v and gate/up storages, at their full size
            allocate_parameters(self.model, self._dropped)  # the other weights
            self._asleep = False

    # ------------------------------------------------------------------ generation
    def warmup(self, sampling: SamplingParams) -> float:
        """The once-per-process start-up work, so that the first generation pays only what every RL step
        pays: compile the layer halves and the sampler on a throwaway request (dynamic shapes: once for every
        later shape) and, on CUDA, load the kernels of large token counts with one prefill forward of the whole
        `prefill_tokens` budget. Then the cache is dropped and the allocator emptied, as a colocated engine's
        `sleep` leaves them each step: the next generation sizes its cache and allocates its activations
        again. Returns the seconds it took."""
        start = time.perf_counter()
        self.generate([[1, 2, 3, 4]], replace(sampling, n=3, max_new_tokens=4), keys=[-1])
        if self.device.type == "cuda":
            self.fill_prefill_budget(sampling)
        self.core = self.cache = None
        self.runner.drop_graphs()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.startup_s += time.perf_counter() - start
        return time.perf_counter() - start

    def fill_prefill_budget(self, sampling: SamplingParams) -> None:
        """A prefill forward of `prefill_tokens` tokens (throwaway prompts, one new token each): the kernels of large
        token counts load (CUDA loads a kernel on its first launch in the process). Up to as many prompts as the
        engine has rows, so the cache needs no more slots than it has anyway (with fewer slots than rows, or
        prompts capped at max_position_embeddings, the tokens take more than one forward)."""
        rows = self.max_batch_size
        each, extra = divmod(self.prefill_tokens, rows)
        lengths = [min(each + (i < extra), self.cfg.max_position_embeddings - 1) for i in range(rows)]
        prompts = [[t % self.cfg.vocab_size for t in range(n)] for n in lengths if n]
        self.generate(prompts, replace(sampling, n=1, max_new_tokens=1), keys=[-1] * len(prompts))

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        keys: list[int] | None = None,
        budgets: list[list[int]] | None = None,
    ) -> list[list[Sample]]:
        """`sampling.n` samples per prompt; result[i] holds prompt i's samples, with group_id = i.

        keys[i] decides the randomness of prompt i's samples (with the seed and the sample index):
        the same key gives the same samples whatever else is generated alongside. None numbers
        the prompts on from the previous call. budgets[i][j] overrides max_new_tokens of sample j.
        """
        if keys is None:
            keys = list(range(self._next_key, self._next_key + len(prompts)))
            self._next_key += len(prompts)
        self.submit(prompts, sampling, keys, tags=list(range(len(prompts))), budgets=budgets)
        results: list[list[Sample]] = [[None] * (len(b) if budgets else sampling.n) for b in (budgets or prompts)]  # type: ignore[list-item]
        while self.has_work:
            for tag, index, sample in self.step():
                results[tag][index] = replace(sample, group_id=tag)
        return results

    # ------------------------------------------------------------------ streaming (the async loop's interface)
    def submit(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        keys: list[int],
        tags: list,
        budgets: list[list[int]] | None = None,
    ) -> None:
        """Queue `sampling.n` samples of each prompt; `step()` returns them as they finish, with their tag.

        Requests in flight keep running; new ones must use the same sampling parameters and fit the
        current cache slots (the cache is sized again only when nothing is in flight)."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if budgets is None:
            budgets = [[sampling.max_new_tokens] * sampling.n for _ in prompts]
        if not len(keys) == len(prompts) == len(budgets) == len(tags):
            raise ValueError(f"{len(prompts)} prompts with {len(keys)} keys, {len(tags)} tags, {len(budgets)} budget lists")
        requests = [Request(tuple(p), tuple(b), int(k), tag=t) for p, k, b, t in zip(prompts, keys, budgets, tags)]
        longest = max((len(r.prompt) + max(r.budgets) for r in requests), default=0)
        if longest > self.cfg.max_position_embeddings:
            raise ValueError(
                f"prompt + max_new_tokens = {longest} exceeds max_position_embeddings={self.cfg.max_position_embeddings}"
            )
        if self.core is not None and self.core.has_work:
            if sampling != self.core.sampling:
                raise ValueError("requests in flight use other sampling parameters; wait until they finish")
            if longest > self.cache.slot_len:
                raise ValueError(f"a request of {longest} tokens does not fit the cache slots ({self.cache.slot_len}) "
                                 "while others are in flight")  # fmt: skip
            core = self.core
        else:
            core = self._core_for(longest, sum(len(r.budgets) for r in requests))
            core.configure(sampling, self.version)
        core.add(requests)

    @property
    def has_work(self) -> bool:
        return self.core is not None and self.core.has_work

    def step(self) -> list[tuple[object, int, Sample]]:
        """One scheduling step of the engine; (tag, sample index, Sample) of every sample that finished."""
        assert self.core is not None, "step() before submit()"
        return [
            (seq.request.tag, seq.index, Sample(
                prompt_ids=seq.request.prompt,
                response_ids=tuple(seq.tokens),
                behav_logprobs=tuple(seq.logprobs),
                finish_reason=seq.finish_reason,
                version=min(seq.versions),
                token_versions=tuple(seq.versions),
            ))
            for seq in self.core.step()
        ]  # fmt: skip

    def _core_for(self, longest: int, num_samples: int) -> EngineCore:
        """The engine core, with a cache whose slots hold `longest` tokens (allocated again only when too short)."""
        if self._asleep or self._dropped is not None:
            raise RuntimeError("the rollout engine is asleep (sleep() freed its weights): update_weights before generating")
        slot_len = min(-(-longest // SLOT_ROUNDING) * SLOT_ROUNDING, self.cfg.max_position_embeddings)
        wanted = self.max_batch_size if self.device.type == "cuda" else min(self.max_batch_size, num_samples)
        old = self.cache
        if old is None or old.slot_len < longest or (self.device.type == "cpu" and old.num_slots < wanted):
            replaced = old.nbytes if old is not None else 0
            self.core = self.cache = old = None  # the old cache is freed before the new one is planned
            self.runner.drop_graphs()
            slots = plan_slots(self.cfg, slot_len, wanted, self.device, self.dtype, self.memory_fraction, replaced)
            self.cache = SlotCache(self.cfg, slots, slot_len, self.device, self.dtype)
            self.core = EngineCore(
                self.runner, self.cache, self.seed, self.prefill_tokens, self.ring, overlap=self.overlap_decode
            )  # fmt: skip
        assert self.core is not None
        return self.core
