"""CPU tests of slipstream.ops.logprobs against float64 full-logits references."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from slipstream.ops.logprobs import choose_tile_sizes, linear_logprobs


def reference(hidden, weight, targets, temperature):
    """Float64 logprobs and entropy from the full (T, V) logits."""
    z = hidden.double() @ weight.double().T / temperature
    logp = z.log_softmax(dim=-1)
    lp = logp.gather(1, targets.unsqueeze(1)).squeeze(1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return lp, entropy


def make_inputs(num_tokens, vocab, hidden_size, dtype=torch.float32, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(num_tokens, hidden_size, generator=gen) * scale).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5 * 3).to(dtype)
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)
    return hidden.requires_grad_(), weight.requires_grad_(), targets


def grads_of(lp, ent, g_lp, g_ent, inputs):
    loss = 0.0
    if g_lp is not None:
        loss = loss + (lp.double() * g_lp).sum()
    if g_ent is not None:
        loss = loss + (ent.double() * g_ent).sum()
    return torch.autograd.grad(loss, inputs)


# callers pass atol / rtol with their measured max |diff| beside them
def check_against_reference(hidden, weight, targets, temperature, g_lp, g_ent, atol, rtol, **kwargs):
    lp, ent = linear_logprobs(hidden, weight, targets, temperature, with_entropy=g_ent is not None, **kwargs)
    assert lp.dtype == torch.float32 and lp.shape == targets.shape
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref_lp, ref_ent = reference(h64, w64, targets, temperature)
    ref_gh, ref_gw = grads_of(ref_lp, ref_ent, g_lp, g_ent, (h64, w64))
    gh, gw = grads_of(lp, ent, g_lp, g_ent, (hidden, weight))
    assert gh.dtype == hidden.dtype and gw.dtype == weight.dtype
    # the caller's tolerance (measured value stated at the call)
    torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=atol, rtol=rtol)
    if g_ent is not None:
        # the caller's tolerance (measured value stated at the call)
        torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=atol, rtol=rtol)
    else:
        assert ent is None
    # the caller's tolerance (measured value stated at the call)
    torch.testing.assert_close(gh.double(), ref_gh, atol=atol, rtol=rtol)
    # the caller's tolerance (measured value stated at the call)
    torch.testing.assert_close(gw.double(), ref_gw, atol=atol, rtol=rtol)


# (T, V, H, chunk_size, vocab_chunk_size): T < V runs the vocab-outer backward, T > V the
# rows-outer one; chunks that do and don't divide T and V; None = automatic sizes.
SHAPES = [
    (37, 50, 16, 8, 16),
    (64, 40, 8, 16, 40),
    (70, 33, 12, 9, 7),
    (30, 61, 12, None, None),
    (5, 7, 4, 64, 100),
]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_float64_reference(shape, temperature):
    num_tokens, vocab, hidden_size, chunk, vchunk = shape
    hidden, weight, targets = make_inputs(num_tokens, vocab, hidden_size)
    gen = torch.Generator().manual_seed(1)
    g_lp = torch.randn(num_tokens, generator=gen, dtype=torch.float64)
    g_ent = torch.randn(num_tokens, generator=gen, dtype=torch.float64)
    check_against_reference(
        # measured max |diff| 8.9e-06 (12% of the tolerance, gradients): 8x margin
        hidden, weight, targets, temperature, g_lp, g_ent, atol=2e-5, rtol=1e-4,
        chunk_size=chunk, vocab_chunk_size=vchunk, impl="torch",
    )


@pytest.mark.parametrize("which", ["logprob_only", "entropy_only"])
def test_single_output_gradients(which):
    hidden, weight, targets = make_inputs(23, 45, 8, seed=3)
    g = torch.randn(23, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    if which == "logprob_only":
        check_against_reference(hidden, weight, targets, 0.7, g, None, 2e-5, 1e-4, chunk_size=6, vocab_chunk_size=10)
    else:
        # entropy requested and used, logprobs computed but not in the loss
        check_against_reference(hidden, weight, targets, 1.3, None, g, 2e-5, 1e-4, chunk_size=6, vocab_chunk_size=10)


def test_gradient_only_for_hidden():
    hidden, weight, targets = make_inputs(19, 31, 8, seed=5)
    weight.requires_grad_(False)
    lp, _ = linear_logprobs(hidden, weight, targets, chunk_size=4, vocab_chunk_size=8)
    (gh,) = torch.autograd.grad(lp.sum(), hidden)
    h64 = hidden.detach().double().requires_grad_()
    (ref_gh,) = torch.autograd.grad(reference(h64, weight.double(), targets, 1.0)[0].sum(), h64)
    # measured max |diff| 1.0e-06: 5x margin
    torch.testing.assert_close(gh.double(), ref_gh, atol=5e-6, rtol=0)


def test_bf16_within_tolerance_and_no_worse_than_naive():
    check_bf16("torch")


def check_bf16(impl):
    """bf16 inputs: our error vs float64 stays within 2x of naive bf16 (logits -> log_softmax)."""
    num_tokens, vocab, hidden_size = 48, 300, 64
    hidden, weight, targets = make_inputs(num_tokens, vocab, hidden_size, dtype=torch.bfloat16, seed=7)
    g_lp = torch.randn(num_tokens, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    lp, ent = linear_logprobs(hidden, weight, targets, 0.7, with_entropy=True, chunk_size=20, vocab_chunk_size=64, impl=impl)
    gh, gw = grads_of(lp, None, g_lp, None, (hidden, weight))

    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref_lp, ref_ent = reference(h64, w64, targets, 0.7)
    ref_gh, ref_gw = grads_of(ref_lp, None, g_lp, None, (h64, w64))

    naive_logp = ((hidden @ weight.T).float() / 0.7).log_softmax(-1)
    naive_lp = naive_logp.gather(1, targets.unsqueeze(1)).squeeze(1)
    naive_gh, naive_gw = grads_of(naive_lp, None, g_lp, None, (hidden, weight))

    def err(a, b):
        return (a.double() - b.detach()).abs().max().item()

    # stated tolerances for bf16 (logits up to ~|15|): 0.05 nats, gradients 2% of their max
    assert err(lp, ref_lp) < 0.05 and err(ent, ref_ent) < 0.05
    assert err(gh, ref_gh) < 0.02 * ref_gh.abs().max().item()
    assert err(gw, ref_gw) < 0.02 * ref_gw.abs().max().item()
    assert err(lp, ref_lp) <= 2 * err(naive_lp, ref_lp) + 1e-3
    assert err(gh, ref_gh) <= 2 * err(naive_gh, ref_gh) + 1e-4
    assert err(gw, ref_gw) <= 2 * err(naive_gw, ref_gw) + 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_never_positive_with_extreme_logits(dtype):
    hidden, weight, targets = make_inputs(40, 64, 16, dtype=dtype, scale=300.0, seed=9)
    with torch.no_grad():
        # half the targets are the argmax (logprob ~ 0), the rest far below it
        logits = hidden.float() @ weight.float().T
        targets[:20] = logits[:20].argmax(dim=1)
    lp, ent = linear_logprobs(hidden, weight, targets, 0.7, with_entropy=True, chunk_size=7, vocab_chunk_size=24)
    assert (lp <= 0).all() and (ent >= 0).all()
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    ref_lp, _ = reference(hidden.detach(), weight.detach(), targets, 0.7)
    # extreme logits: measured max |diff| 4.8e-04, 2x margin
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-3, rtol=0)
    gh, gw = torch.autograd.grad(lp.sum() + ent.sum(), (hidden, weight))
    assert torch.isfinite(gh).all() and torch.isfinite(gw).all()


def test_out_of_range_target_is_nan():
    hidden, weight, targets = make_inputs(6, 10, 4)
    targets[2] = 10
    lp, _ = linear_logprobs(hidden.detach(), weight.detach(), targets, vocab_chunk_size=4)
    assert torch.isnan(lp[2]) and torch.isfinite(lp[[0, 1, 3, 4, 5]]).all()


def saved_tensor_numels(fn):
    """Numel of every tensor the autograd graph saves while running fn()."""
    numels = []

    def pack(t):
        numels.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return numels, out


def test_graph_saves_no_full_logits():
    num_tokens, vocab, hidden_size = 4096, 32000, 16
    hidden, weight, targets = make_inputs(num_tokens, vocab, hidden_size)
    numels, (lp, ent) = saved_tensor_numels(
        lambda: linear_logprobs(hidden, weight, targets, with_entropy=True, impl="torch")
    )
    assert numels, "the hook saw nothing: the graph was not recorded"
    assert max(numels) < num_tokens * vocab
    assert lp.requires_grad and ent.requires_grad

    # the detector does catch the naive formulation (small sizes)
    h, w, y = make_inputs(64, 100, 8)
    naive = lambda: (h @ w.T).log_softmax(-1).gather(1, y.unsqueeze(1))  # noqa: E731
    assert max(saved_tensor_numels(naive)[0]) >= 64 * 100


def test_tile_size_choice():
    assert choose_tile_sizes(10, 50) == (10, 50)  # small problems: a single tile
    rows, cols = choose_tile_sizes(65536, 151936)
    assert cols == 16384 and rows % 64 == 0 and rows * cols * 4 * 3 <= 256 * 2**20
    assert choose_tile_sizes(100, 1000, chunk_size=7, vocab_chunk_size=3000) == (7, 1000)


def test_input_validation():
    hidden, weight, targets = make_inputs(4, 9, 3)
    with pytest.raises(ValueError, match="hidden size"):
        linear_logprobs(hidden, weight[:, :2], targets)
    with pytest.raises(ValueError, match="temperature"):
        linear_logprobs(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="int64"):
        linear_logprobs(hidden, weight, targets.float())
    with pytest.raises(ValueError, match="impl"):
        linear_logprobs(hidden, weight, targets, impl="cuda")
    with pytest.raises(ValueError, match="shape"):
        linear_logprobs(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="dtype"):
        linear_logprobs(hidden, weight.detach().double(), targets)
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="triton"):
            linear_logprobs(hidden, weight, targets, impl="triton")


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not _INTERPRET, reason="needs triton and TRITON_INTERPRET=1 to run kernels on the CPU")
@pytest.mark.parametrize("shape", [(37, 50, 16, 8, 16), (70, 33, 12, 9, 7)])
def test_triton_kernels_in_interpreter(shape):
    from slipstream.ops.logprobs_triton import triton_forward_stats

    num_tokens, vocab, hidden_size, chunk, vchunk = shape
    hidden, weight, targets = make_inputs(num_tokens, vocab, hidden_size, seed=11)
    g_lp, g_ent = torch.randn(2, num_tokens, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    check_against_reference(
        hidden, weight, targets, 0.7, g_lp, g_ent, 2e-5, 1e-4, chunk_size=chunk, vocab_chunk_size=vchunk, impl="triton"
    )
    # vocab split across programs, merged on the host
    zy, lse, ent = triton_forward_stats(hidden.detach(), weight.detach(), targets, 1 / 0.7, True, num_splits=3)
    ref_lp, ref_ent = reference(hidden.detach(), weight.detach(), targets, 0.7)
    # not measured here (needs triton); the torch path's twin check measured <= 8.9e-06
    torch.testing.assert_close((zy - lse).double(), ref_lp, atol=2e-5, rtol=1e-4)
    # not measured here (needs triton); the torch path's twin check measured <= 8.9e-06
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not _INTERPRET, reason="needs triton and TRITON_INTERPRET=1 to run kernels on the CPU")
def test_triton_bf16_in_interpreter():
    check_bf16("triton")
