"""The actor's optimizer: torch AdamW over fp32 master weights, or AdamW over bf16 weights with stochastic rounding.

`actor.master_dtype=float32` (the default) keeps fp32 parameters, gradients and AdamW state:
16 bytes per parameter. `actor.master_dtype=bfloat16` keeps all four in bf16, 8 bytes per
parameter, the memory class of TRL's and verl's bf16 training. Plain bf16 AdamW loses every
update smaller than half a bf16 step (relative 2^-9): at an RL learning rate of 1e-6 that is
nearly all of them, and the second moment's (1 - beta2) = 1e-3 increments vanish the same way.
`StochasticRoundingAdamW` does the AdamW arithmetic in fp32 and writes the new weights and both
moments back to bf16 with stochastic rounding: a value between two bf16 neighbours rounds up
with probability equal to its distance from the lower one, so the rounding is unbiased and
small updates survive in expectation.

Stochastic rounding of an fp32 `x` to bf16: add 16 uniformly random bits to the low half of
x's bit pattern and truncate it. The low 16 bits are exactly what bf16 drops, and the carry
into the upper half happens with probability (low bits) / 2^16. On the sign-magnitude bit
pattern this rounds the magnitude, so the sign never flips and zero stays zero; NaNs are
passed through unchanged (the carry could turn a NaN pattern into inf or zero).

Random bits come from a generator seeded at every step from (seed, optimizer step, rank); the
optimizer step is kept in the param group, so it is saved with the optimizer and a resumed run
draws the same bits as one that never stopped. The engines use seed 0: the rounding noise only
has to be independent of the values, not different between runs.

Gradients are bf16 too: the micro-batches of a step accumulate into them in bf16 (as TRL's
bf16 training does), a relative error of a few 1e-3 on the summed gradient. The gradient norm
used for clipping and logging is computed in fp32 (engine/local.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from slipstream.config.schema import ActorSection

CHUNK = 1 << 24
"""Elements per chunk of the bf16 update: bounds its fp32 temporaries to a few hundred MiB."""
_LOW_BITS = 1 << 16
_HIGH_MASK = -_LOW_BITS  # 0xFFFF0000 as a signed int32


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """bf16 copy of the fp32 tensor `x`, rounded up or down at random with the unbiased probabilities."""
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic rounding takes a float32 tensor, got {x.dtype}")
    noise = torch.randint(0, _LOW_BITS, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    return _round_with_bits(x.contiguous(), noise)


def _round_with_bits(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding of fp32 `x` with 16 random bits per element (int32 values in [0, 2^16))."""
    bits = x.view(torch.int32) + noise
    # After the mask the value is exactly representable in bf16, so the cast does not round again.
    rounded = (bits & _HIGH_MASK).view(torch.float32).to(torch.bfloat16)
    return torch.where(x.isnan(), x.to(torch.bfloat16), rounded)


def _adamw_update(p, g, m, v, noise, hp) -> None:
    """One AdamW update of a chunk in fp32, written back in place to bf16 with stochastic rounding.

    p, g, m, v: bf16 chunks (parameter, gradient, exp_avg, exp_avg_sq); noise: int64 with 48
    random bits per element (16 for each of the three roundings); hp: fp32 tensor
    [lr, beta1, beta2, eps, weight_decay, 1 - beta1^t, 1 - beta2^t]. A pure function of tensors, so
    torch.compile fuses it into one kernel and changing hyperparameters never recompile it.
    """
    lr, beta1, beta2, eps, wd, bias1, bias2 = hp.unbind()
    g32 = g.float()
    m32 = m.float() * beta1 + g32 * (1 - beta1)
    v32 = v.float() * beta2 + g32 * g32 * (1 - beta2)
    p32 = p.float() * (1 - lr * wd) - (lr / bias1) * m32 / ((v32 / bias2).sqrt() + eps)
    low16 = [((noise >> shift) & (_LOW_BITS - 1)).to(torch.int32) for shift in (0, 16, 32)]
    p.copy_(_round_with_bits(p32, low16[0]))
    m.copy_(_round_with_bits(m32, low16[1]))
    v.copy_(_round_with_bits(v32, low16[2]))


_compiled_update = None


def _compiled_adamw_update():
    """`_adamw_update` under torch.compile (dynamic shapes: one graph for every chunk length)."""
    global _compiled_update
    if _compiled_update is None:
        _compiled_update = torch.compile(_adamw_update, dynamic=True)
    return _compiled_update


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard (AdamW is elementwise), else `t`."""
    return t.to_local() if hasattr(t, "to_local") else t


class StochasticRoundingAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, torch.optim.AdamW's formula) over bf16 parameters and bf16 moments.

    Each step computes in fp32 and writes parameters, exp_avg and exp_avg_sq back to bf16 with
    stochastic rounding. State keys and shapes match torch's AdamW (`step`, `exp_avg`,
    `exp_avg_sq`), so torch.distributed.checkpoint saves and loads it like any optimizer.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        seed: int = 0,
        rank: int = 0,
        compiled: bool = False,
    ) -> None:
        # sr_step: optimizer steps taken (seeds the rounding; in the param group so it is checkpointed)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, sr_step=0)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.bfloat16:
                    raise TypeError(f"StochasticRoundingAdamW keeps bf16 parameters, got one in {p.dtype}")
        self.seed = seed
        self.rank = rank
        self.update = _compiled_adamw_update() if compiled else _adamw_update
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device, step: int) -> torch.Generator:
        """The device's generator, seeded for this (seed, step, rank) on its first use in a step."""
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        # distinct streams per (seed, step, rank); the constants only spread the three apart
        gen.manual_seed((self.seed * 1_000_003 + step * 65_537 + self.rank) % (1 << 63))
        return gen

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        seeded: set[tuple[int, torch.device]] = set()
        hyper: dict[tuple[int, torch.device, int], torch.Tensor] = {}
        for group_index, group in enumerate(self.param_groups):
            group["sr_step"] = group.get("sr_step", 0) + 1  # absent in a state dict saved by torch's AdamW
            stream = group["sr_step"] * len(self.param_groups) + group_index
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = int(state["step"])
                param, grad = _local(p), _local(p.grad)
                if param.numel() == 0:
                    continue
                if (group_index, param.device) not in seeded:  # one stream per group, device and step
                    self._generator(param.device, stream)
                    seeded.add((group_index, param.device))
                gen = self._generators[param.device]
                key = (group_index, param.device, step)
                if key not in hyper:  # one small host-to-device copy per group, device and step
                    values = [lr, beta1, beta2, eps, wd, 1 - beta1**step, 1 - beta2**step]
                    hyper[key] = torch.tensor(values, dtype=torch.float32).to(param.device, non_blocking=True)
                flat = [t.view(-1) for t in (param, grad, _local(state["exp_avg"]), _local(state["exp_avg_sq"]))]
                for start in range(0, param.numel(), CHUNK):
                    p_c, g_c, m_c, v_c = (t[start : start + CHUNK] for t in flat)
                    noise = torch.randint(0, 1 << 48, p_c.shape, dtype=torch.int64, device=p_c.device, generator=gen)
                    self.update(p_c, g_c, m_c, v_c, noise, hyper[key])
        return loss


def build_optimizer(params: Iterable[torch.Tensor], actor: ActorSection, *, fused: bool, rank: int = 0) -> torch.optim.Optimizer:
    """The actor's optimizer for `actor.master_dtype` (module docstring)."""
    kwargs = dict(lr=actor.lr, betas=tuple(actor.betas), eps=actor.eps, weight_decay=actor.weight_decay)
    if actor.master_dtype == "bfloat16":
        # actor.compile also compiles the update (one fused kernel per chunk instead of ~20)
        return StochasticRoundingAdamW(params, **kwargs, rank=rank, compiled=actor.compile)
    return torch.optim.AdamW(params, **kwargs, fused=fused)
