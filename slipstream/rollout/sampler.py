"""Sampling on the device with keyed randomness: temperature, top-k, top-p, behaviour log-probs.

A sample's randomness is a function of (seed, request key, sample index, token index) only, never
of the slot, batch or rank it runs in: each response token is drawn by the Gumbel-max trick,

    token = argmax_v ( logits_v / T + g_v ),   g_v = -log(-log(u_v)),   u_v = hash(row seed, token index, v)

with a counter-based integer hash instead of a stateful generator. argmax of Gumbel-perturbed
logits is an exact sample of softmax(logits / T) (restricted to the top-k / top-p set), it needs
no sort and no cumulative sum over the vocabulary, and it is one elementwise pass plus one
reduction, which torch.compile fuses into a single kernel on the GPU.

Behaviour log-probs are log_softmax(logits / T) at the sampled token over the untruncated
tempered distribution, in fp32: the quantity the trainer recomputes. Greedy decoding
(temperature 0) takes the argmax and reports the log-prob at temperature 1.
"""

from __future__ import annotations

import torch

from slipstream.rollout.base import SamplingParams

_MASK32 = 0xFFFFFFFF
_VOCAB_SALT = 0x5BD1E995


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (Wellons' "lowbias32") of int32 tensors holding 32-bit patterns.

    int32, not int64: the GPU multiplies 32-bit integers natively (64-bit products take several
    instructions), and the noise of a whole (B, V) row block is hashed every decode step. The products
    wrap modulo 2**32 on every device torch runs on; the right shifts are made logical by masking the
    bits an arithmetic shift copies from the sign.
    """
    if x.dtype != torch.int32:  # int64 products would not wrap at 32 bits: as_int32 first
        raise TypeError(f"mix32 takes int32 bit patterns (see as_int32), got {x.dtype}")
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * (0x846CA68B - (1 << 32))  # the constant's 32-bit pattern as a signed int32
    return x ^ ((x >> 16) & 0xFFFF)


def as_int32(x: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of an integer tensor as int32 (two's complement), exactly on every device."""
    low = x.long() & _MASK32
    return (low - ((low >> 31) << 32)).to(torch.int32)


def _mix32_int(x: int) -> int:
    """`mix32` on a Python int in [0, 2**32) (host side, same function, unsigned result)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def row_seed(seed: int, key: int, sample_index: int) -> int:
    """The 32-bit seed of one sample: a hash of (sampler seed, request key, sample index), on the host."""
    h = 0
    for part in (seed, key, sample_index):
        part &= (1 << 64) - 1  # negative keys and seeds hash as their two's-complement bits
        for word in (part & _MASK32, part >> 32):
            h = _mix32_int(h ^ word)
    return h


def vocab_hashes(vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """Per-vocabulary-entry hash (V,) int32, computed once per engine and mixed with each row's stream."""
    return mix32(as_int32(torch.arange(vocab_size, dtype=torch.int64, device=device) + _VOCAB_SALT))


def gumbel_noise(seeds: torch.Tensor, token_index: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise (B, V) fp32 for rows with 32-bit `seeds` (B,) at response position `token_index` (B,)."""
    stream = mix32(as_int32(seeds) ^ mix32(as_int32(token_index)))  # (B,) one stream per row and position
    bits = (mix32(stream[:, None] ^ vocab_hash[None, :]) >> 8) & 0xFFFFFF  # (B, V), 24 random bits
    u = (bits.float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1), never 0 or 1
    return -torch.log(-torch.log(u))


def top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor, iterations: int = 31) -> torch.Tensor:
    """The smallest kept probability (B, 1) of nucleus sampling, by bisection instead of a sort.

    Sorted descending, the cumulative mass first reaches `top_p` at some token; every token whose
    probability is at least that token's is kept, so ties at the cut are all kept. That
    probability is the largest t among the probabilities with sum(p[p >= t]) >= top_p. The mass
    above t only falls as t grows, so bisection over the bit pattern of t (non-negative floats
    order like their int32 bits) finds it exactly in 31 masked reductions over the vocabulary.
    """
    lo = torch.zeros(probs.shape[0], 1, dtype=torch.int32, device=probs.device)  # mass(lo) >= top_p always
    hi = torch.full_like(lo, 0x3F800001)  # bits of a value just above 1.0: mass(hi) = 0 < top_p
    for _ in range(iterations):
        mid = lo + (hi - lo) // 2
        t = mid.view(torch.float32)
        ok = (probs * (probs >= t)).sum(-1, keepdim=True) >= top_p
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid)
    # lo is the largest bit pattern whose mass reaches top_p; the kept set is {p >= value of lo}
    return lo.view(torch.float32)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float | torch.Tensor) -> torch.Tensor:
    """Set logits outside the top-k and nucleus (top-p) sets to -inf; (B, V) -> (B, V). Ties at a cut are kept."""
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if not isinstance(top_p, torch.Tensor):
        if top_p >= 1.0:
            return logits
        top_p = torch.tensor(top_p, dtype=torch.float32, device=logits.device)
    probs = logits.float().softmax(dim=-1)
    return logits.masked_fill(probs < top_p_threshold(probs, top_p), float("-inf"))


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor | float,
    seeds: torch.Tensor | None,
    token_index: torch.Tensor | None,
    vocab_hash: torch.Tensor | None,
    greedy: bool,
    top_k: int = 0,
    top_p: torch.Tensor | float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from fp32 logits (B, V); returns (tokens (B,) int64, behaviour log-probs (B,) fp32).

    Pure tensor code with static control flow (branches depend on Python values only), so it can
    be compiled and captured in a CUDA graph. `seeds`, `token_index` (B,) int64 and `vocab_hash`
    (V,) are needed unless `greedy`.
    """
    if greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, logits.gather(-1, tokens[:, None]).squeeze(-1) - logits.logsumexp(dim=-1)
    scaled = logits / temperature
    lse = scaled.logsumexp(dim=-1)
    kept = filter_logits(scaled, top_k, top_p) if (top_k > 0 or _below_one(top_p)) else scaled
    tokens = (kept + gumbel_noise(seeds, token_index, vocab_hash)).argmax(dim=-1)
    return tokens, scaled.gather(-1, tokens[:, None]).squeeze(-1) - lse


def _below_one(top_p: torch.Tensor | float) -> bool:
    """Whether a top-p filter is asked for (a tensor top_p always is: its value is set at run time)."""
    return isinstance(top_p, torch.Tensor) or top_p < 1.0


def sampling_mode(sampling: SamplingParams) -> tuple[bool, int, bool]:
    """(greedy, top_k, uses top_p): the parts of SamplingParams that change the sampling code."""
    top_k = sampling.top_k if sampling.top_k > 0 else 0
    return sampling.greedy, top_k, sampling.top_p < 1.0
