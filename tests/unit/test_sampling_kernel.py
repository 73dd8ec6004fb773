"""The one-pass Triton sampling kernel against `sample_tokens` (torch) on the same logits and keys.

Runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1 with triton installed), and on
CUDA without it; skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from slipstream.rollout.sampler import sample_tokens, vocab_hashes

_TRITON = importlib.util.find_spec("triton") is not None
_RUNS = _TRITON and (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available())
pytestmark = pytest.mark.skipif(not _RUNS, reason="needs triton, and CUDA or TRITON_INTERPRET=1")
_DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


@pytest.mark.parametrize("block", [256, 2048])  # several vocabulary chunks per row, and one
@pytest.mark.parametrize("greedy", [False, True])
def test_sample_rows_equals_sample_tokens(greedy, block, monkeypatch):
    from slipstream.ops import sampling

    monkeypatch.setattr(sampling, "BLOCK", block)
    rows, vocab = 6, 5000
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(_DEVICE)
    # a three-way tie: across chunks (block 256) or across lanes of one block (2048), and within one lane
    # (17 + 2048): the lowest id wins
    logits[0, 17] = logits[0, 4000] = logits[0, 2065] = logits[0].max() + 1
    logits[1, :1500] = float("-inf")  # masked entries filling whole blocks and a whole chunk: no NaN
    seeds = torch.tensor([0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 123456789], dtype=torch.int64, device=_DEVICE)
    index = torch.tensor([0, 3, 100, 4095, 1, 7], dtype=torch.int64, device=_DEVICE)
    temperature = torch.tensor(0.7, device=_DEVICE)
    hashes = vocab_hashes(vocab, _DEVICE)
    assert sampling.num_chunks(rows, vocab, torch.device(_DEVICE)) == (5 if block == 256 else 1)

    want_tokens, want_logprobs = sample_tokens(logits, temperature, seeds, index, hashes, greedy)
    tokens, logprobs = sampling.sample_rows(logits, temperature, seeds, index, hashes, greedy)
    # the same noise bits; the final logs may round differently by an ulp: a change of token would need two noisy
    # values within ~1e-6 of each other (none here)
    assert tokens.tolist() == want_tokens.tolist()
    assert torch.isfinite(logprobs).all()
    if greedy:
        assert tokens[0] == 17
    # the online logsumexp adds in another order: measured max |diff| ~1e-6 on logits of ~10
    torch.testing.assert_close(logprobs, want_logprobs, atol=1e-5, rtol=0)


def test_sample_rows_draws_from_the_softmax():
    """Frequencies over many keys match softmax(logits / T): the kernel's draw is a sample, not a fixed token."""
    from slipstream.ops import sampling

    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    n = 20_000
    logits = (probs.log() * 0.5)[None].expand(n, -1).contiguous().to(_DEVICE)  # T = 0.5 undoes the factor
    seeds = (torch.arange(n, dtype=torch.int64) * 7919 % (1 << 32)).to(_DEVICE)
    index = torch.zeros(n, dtype=torch.int64, device=_DEVICE)
    tokens, logprobs = sampling.sample_rows(
        logits, torch.tensor(0.5, device=_DEVICE), seeds, index, vocab_hashes(6, _DEVICE), greedy=False
    )
    freqs = torch.bincount(tokens.cpu(), minlength=6).float() / n
    # 20k draws: standard error <= 0.0035; 4 standard errors
    torch.testing.assert_close(freqs, probs, atol=0.014, rtol=0)
    torch.testing.assert_close(logprobs.cpu(), probs.log()[tokens.cpu()], atol=1e-5, rtol=0)


@pytest.mark.parametrize("greedy", [False, True])
def test_sample_hidden_equals_the_lm_head_then_sample_rows(greedy, monkeypatch):
    """The fused LM-head kernel draws what the fp32 logits of the matmul draw through `sample_rows`."""
    from slipstream.ops import sampling

    # small tiles: several row blocks, vocabulary slices and tiles per slice, a hidden size the K tile does not
    # divide, a row count the row tile does not divide
    monkeypatch.setitem(sampling.HEAD_LAUNCH, "block_m", 16)
    monkeypatch.setitem(sampling.HEAD_LAUNCH, "block_n", 32)
    monkeypatch.setitem(sampling.HEAD_LAUNCH, "block_k", 16)
    rows, vocab, size = 21, 700, 40
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(rows, size, generator=g)
    weight = torch.randn(vocab, size, generator=g) * 0.5
    # identical rows of the head: a tie within a tile (20, 25), across tiles of a slice (60) and across slices
    # (450); row 0 points at them, so greedy must take the lowest id
    weight[[25, 60, 450]] = weight[20].clone()
    hidden[0] = 4 * weight[20]
    hidden, weight = hidden.to(_DEVICE), weight.to(_DEVICE)
    seeds = (torch.arange(rows, dtype=torch.int64) * 2654435761 % (1 << 32)).to(_DEVICE)
    index = torch.arange(rows, dtype=torch.int64, device=_DEVICE) * 5
    temperature = torch.tensor(0.8, device=_DEVICE)
    hashes = vocab_hashes(vocab, _DEVICE)
    splits, cols = sampling._slices(vocab, sampling.head_splits(rows, vocab, torch.device(_DEVICE)), 32)
    assert cols % 32 == 0 and 32 <= 60 < cols <= 450  # the ties sit where the comment says

    logits = hidden @ weight.t()
    want_tokens, want_logprobs = sampling.sample_rows(logits, temperature, seeds, index, hashes, greedy)
    tokens, logprobs = sampling.sample_hidden(hidden, weight, temperature, seeds, index, hashes, greedy)
    assert tokens.tolist() == want_tokens.tolist()
    if greedy:
        assert tokens[0] == 20
    torch.testing.assert_close(logprobs, want_logprobs, atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        sampling.sample_hidden(hidden, weight.t().contiguous().t(), temperature, seeds, index, hashes, greedy)


@pytest.mark.skipif(_DEVICE != "cuda", reason="bf16 matmuls at qwen3's shapes: CUDA only (the interpreter's bf16 dot is not exact)")
@pytest.mark.parametrize("rows", [1, 8, 65, 256])
def test_sample_hidden_in_bf16_at_qwen3_shapes(rows):
    """The production path: bf16 hidden states and head (qwen3-0.6b's 1024 x 151,936), the default launch."""
    from slipstream.ops import sampling
    from slipstream.ops.logprobs import mm_fp32

    g = torch.Generator(device="cuda").manual_seed(rows)
    weight = (torch.randn(151_936, 1024, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    hidden = torch.randn(rows, 1024, device="cuda", generator=g).to(torch.bfloat16)
    seeds = torch.randint(0, 1 << 32, (rows,), device="cuda", generator=g)
    index = torch.randint(0, 4096, (rows,), device="cuda", generator=g)
    temperature = torch.tensor(0.6, device="cuda")
    hashes = vocab_hashes(151_936, "cuda")
    for greedy in (False, True):
        want = sampling.sample_rows(mm_fp32(hidden, weight.t()), temperature, seeds, index, hashes, greedy)
        got = sampling.sample_hidden(hidden, weight, temperature, seeds, index, hashes, greedy)
        # the logits differ only in the order of the fp32 additions: tokens part only at near-ties
        assert (got[0] == want[0]).float().mean() >= 0.99
        same = got[0] == want[0]
        torch.testing.assert_close(got[1][same], want[1][same], atol=1e-4, rtol=0)
