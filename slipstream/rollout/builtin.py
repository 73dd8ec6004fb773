"""Builtin rollout engine: batched sampling from a native `Transformer` with a KV cache.

Simple rather than fast: static batches of left-padded prompts, one forward per new token
for the whole batch, finished rows keep decoding (ignored) until every row is done. Good
for tests, CPU runs and small models; use an SGLang / vLLM server for real throughput.
"""

from __future__ import annotations

from typing import Iterable

import torch

from slipstream.batching.records import Sample
from slipstream.models.config import ModelConfig
from slipstream.models.hf import load_hf_weights_into
from slipstream.models.transformer import KVCache, Transformer
from slipstream.ops.logprobs import mm_fp32
from slipstream.rollout.base import SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus (top-p) set to -inf; (B, V) -> (B, V)."""
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the top token
        # always survives because nothing ranks above it.
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from fp32 logits (B, V); returns (tokens (B,), behaviour logprobs (B,))."""
    if sampling.greedy:
        tokens = logits.argmax(dim=-1)
        logprobs = logits.log_softmax(dim=-1)
    else:
        scaled = logits / sampling.temperature
        # The behaviour log-prob uses the full (untruncated) tempered distribution: that is
        # what the trainer recomputes from logits / temperature.
        logprobs = scaled.log_softmax(dim=-1)
        probs = filter_logits(scaled, sampling.top_k, sampling.top_p).softmax(dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


class BuiltinRollout:
    """In-process RolloutEngine owning its own `Transformer`."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 64,
        seed: int = 0,
        pad_token_id: int = 0,
        attn_backend: str | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.cfg = model_cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.pad_token_id = pad_token_id
        self.version = 0
        self.model = Transformer(model_cfg, attn_backend).to(device=self.device, dtype=dtype)
        self.model.init_weights(seed)
        self.model.eval().requires_grad_(False)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    # ------------------------------------------------------------------ weights

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy HF-named tensors into the model; every parameter must be provided."""
        updated = load_hf_weights_into(self.model, named_tensors)
        missing = sorted(set(self.model.state_dict()) - updated)
        if missing:
            raise ValueError(f"update_weights left {len(missing)} weights unset, e.g. {missing[:4]}")
        self.version = int(version)

    def state_dict(self) -> dict:
        """Sampler RNG and policy version, so a resumed run samples exactly what it would have."""
        return {"generator": self.generator.get_state(), "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.version = int(state["version"])

    def sleep(self) -> None:
        """Move weights to the CPU so the accelerator memory is free for training."""
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """Bring the weights back to the engine's device."""
        self.model.to(self.device)

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[list[Sample]]:
        """n samples per prompt; result[i] holds prompt i's samples, with group_id = i."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        longest = max((len(p) for p in prompts), default=0)
        if longest + sampling.max_new_tokens > self.cfg.max_position_embeddings:
            raise ValueError(
                f"prompt ({longest}) + max_new_tokens ({sampling.max_new_tokens}) exceeds "
                f"max_position_embeddings={self.cfg.max_position_embeddings}"
            )
        # Each prompt is repeated n times; rows are generated in chunks of max_batch_size.
        requests = [i for i in range(len(prompts)) for _ in range(sampling.n)]
        results: list[list[Sample]] = [[] for _ in prompts]
        for lo in range(0, len(requests), self.max_batch_size):
            chunk = requests[lo : lo + self.max_batch_size]
            outputs = self._generate_batch([prompts[i] for i in chunk], sampling)
            for i, (ids, logprobs, finish) in zip(chunk, outputs):
                results[i].append(
                    Sample(
                        prompt_ids=tuple(prompts[i]),
                        response_ids=tuple(ids),
                        behav_logprobs=tuple(logprobs),
                        group_id=i,
                        finish_reason=finish,
                        version=self.version,
                    )
                )
        return results

    @torch.no_grad()
    def _generate_batch(
        self, prompts: list[list[int]], sampling: SamplingParams
    ) -> list[tuple[list[int], list[float], str]]:
        """Generate one completion per row; returns (response ids, logprobs, finish reason)."""
        dev, bsz, max_new = self.device, len(prompts), sampling.max_new_tokens
        prompt_len = max(len(p) for p in prompts)
        # Left padding lines up every prompt's last token in the same column, so one decode
        # step appends one column for the whole batch.
        ids = torch.full((bsz, prompt_len), self.pad_token_id, dtype=torch.long)
        valid = torch.zeros((bsz, prompt_len + max_new), dtype=torch.bool)
        for row, p in enumerate(prompts):
            ids[row, prompt_len - len(p) :] = torch.tensor(p, dtype=torch.long)
            valid[row, prompt_len - len(p) : prompt_len] = True
        ids, valid = ids.to(dev), valid.to(dev)
        # Positions count real tokens only, so they restart at 0 after the padding.
        positions = (valid[:, :prompt_len].long().cumsum(-1) - 1).clamp(min=0)
        next_pos = valid[:, :prompt_len].sum(-1)  # (B,) = prompt length

        cache = KVCache(self.cfg, bsz, prompt_len + max_new, dev, self.dtype)
        hidden = self.model.forward_cached(ids, positions, cache, valid[:, :prompt_len])
        stop_ids = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=dev)
        tokens = torch.full((bsz, max_new), self.pad_token_id, dtype=torch.long, device=dev)
        logprobs = torch.zeros((bsz, max_new), dtype=torch.float32, device=dev)
        done = torch.zeros(bsz, dtype=torch.bool, device=dev)
        num_steps = max_new
        for step in range(max_new):
            # fp32 logits from an fp32-accumulated matmul (not bf16-rounded logits), as the trainer's
            # fused log-prob op computes them, so behaviour and trainer log-probs agree closely
            logits = mm_fp32(hidden[:, -1], self.model.lm_head_weight.t())
            tok, lp = sample_tokens(logits, sampling, self.generator)
            tokens[:, step] = torch.where(done, self.pad_token_id, tok)
            logprobs[:, step] = torch.where(done, 0.0, lp)
            done = done | torch.isin(tok, stop_ids)
            # One host sync per step to stop early once every row has finished.
            if step == max_new - 1 or bool(done.all()):
                num_steps = step + 1
                break
            valid[:, prompt_len + step] = True
            hidden = self.model.forward_cached(
                tok[:, None], next_pos[:, None], cache, valid[:, : prompt_len + step + 1]
            )
            next_pos = next_pos + 1

        tokens, logprobs = tokens[:, :num_steps].tolist(), logprobs[:, :num_steps].tolist()
        stop_set = set(sampling.stop_token_ids)
        outputs = []
        for row in range(bsz):
            row_tokens = tokens[row]
            end = next((j + 1 for j, t in enumerate(row_tokens) if t in stop_set), None)
            if end is None:
                outputs.append((row_tokens, logprobs[row], "length"))
            else:
                outputs.append((row_tokens[:end], logprobs[row][:end], "stop"))
        return outputs
