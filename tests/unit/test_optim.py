"""bf16 master weights: stochastic rounding and StochasticRoundingAdamW against float64 references."""

from __future__ import annotations

import pytest
import torch

from engine_checks import assert_weights_close
from slipstream.config.schema import ActorSection, Config
from slipstream.engine.factory import build_engine
from slipstream.engine import optim as optim_module
from slipstream.engine.optim import StochasticRoundingAdamW, build_optimizer, stochastic_round_to_bf16
from slipstream.batching.shard import local_micro_batches
from slipstream.engine.fsdp import FSDPEngine
from slipstream.engine.local import LocalEngine
from slipstream.models import hf
from test_fsdp import ACTOR, BATCHES, BF16_ACTOR, CAP, CPU, LOSSES, METRICS, make_model, run_steps

pytestmark = pytest.mark.usefixtures("one_thread")


def _bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(toward zero, away from zero) bf16 neighbours of fp32 values, in float64."""
    bits = x.view(torch.int32)
    low = (bits & -65536).view(torch.float32)
    high = ((bits & -65536) + 65536).view(torch.float32)
    return low.double(), high.double()


def test_stochastic_rounding_is_unbiased_between_the_two_neighbours():
    gen = torch.Generator().manual_seed(0)
    values = torch.cat([torch.randn(6, generator=gen) * 10.0 ** torch.arange(-6, 0).float(), -torch.rand(4, generator=gen)])
    draws = 20000
    x = values.repeat(draws, 1)  # each column: one value drawn `draws` times
    rounded = stochastic_round_to_bf16(x, torch.Generator().manual_seed(1)).double()
    low, high = _bf16_neighbours(values)
    assert ((rounded == low) | (rounded == high)).all()  # never further than the two neighbours
    assert (torch.sign(rounded) == torch.sign(x.double())).all()
    # the mean of the draws is the fp32 value: the probability of rounding away from zero is the
    # distance from the lower neighbour, relative to the gap (standard error sqrt(p(1-p)/draws) * gap)
    gap = (high - low).abs()
    assert ((rounded.mean(0) - values.double()).abs() <= 4 * 0.5 / draws**0.5 * gap).all()  # per value
    # both neighbours are drawn: round-to-nearest would give one of them every time
    assert ((rounded == low).any(0) & (rounded == high).any(0)).all()


def test_stochastic_rounding_keeps_representable_values_and_specials():
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, 3.0e38, 1e-30, float("inf"), float("-inf")]).bfloat16().float()
    out = stochastic_round_to_bf16(exact, torch.Generator().manual_seed(0))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out.float(), exact)
    # every NaN bit pattern stays NaN (adding the noise could carry it into inf or zero)
    nans = torch.tensor([0x7FC00000, 0x7FFFFFFF, 0x7F800001, -1, -0x7FFFFF], dtype=torch.int32).view(torch.float32)
    assert nans.isnan().all()
    for seed in range(5):
        assert stochastic_round_to_bf16(nans, torch.Generator().manual_seed(seed)).isnan().all()
    with pytest.raises(TypeError, match="float32"):
        stochastic_round_to_bf16(torch.ones(2, dtype=torch.float64))


def _adam_steps(opt_cls, p0: torch.Tensor, grads: list[torch.Tensor], **kw) -> torch.Tensor:
    p = torch.nn.Parameter(p0.clone())
    opt = opt_cls([p], **kw)
    for g in grads:
        p.grad = g.to(p.dtype)
        opt.step()
    return p.detach()


def test_small_updates_survive_in_expectation_where_plain_bf16_adamw_loses_them():
    """lr 1e-5 on weights ~0.02: each step is a fraction of a bf16 step, as in RL fine-tuning."""
    gen = torch.Generator().manual_seed(0)
    n, steps, lr = 200_000, 40, 1e-5
    p0 = (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16)
    direction = torch.randn(n, generator=gen).sign()
    grads = [direction * (1 + 0.1 * torch.randn(n, generator=gen)) for _ in range(steps)]
    kw = dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    ref = _adam_steps(torch.optim.AdamW, p0.double(), [g.double() for g in grads], **kw)
    sr = _adam_steps(StochasticRoundingAdamW, p0, grads, **kw).double()
    plain = _adam_steps(torch.optim.AdamW, p0, grads, **kw).double()

    def moved(p: torch.Tensor) -> float:  # mean displacement along the descent direction
        return float(((p0.double() - p) * direction).mean())

    # measured rel 4.4e-03: 2.3x margin
    assert moved(ref) == pytest.approx(steps * lr, rel=0.01)  # Adam moves ~lr per step here
    # measured rel 2.9e-04: 3.4x margin
    assert moved(sr) == pytest.approx(moved(ref), rel=1e-3)
    assert moved(plain) < 0.5 * moved(ref)  # the failure stochastic rounding is there to fix
    # per element the error is a few bf16 steps of random walk, not a drift
    err = sr - ref
    assert abs(float(err.mean())) < 0.01 * moved(ref)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_float64_adamw_when_updates_are_large(weight_decay):
    """Bias correction, decoupled weight decay, betas and eps follow torch's AdamW formula."""
    gen = torch.Generator().manual_seed(1)
    n, steps = 4096, 8
    p0 = torch.randn(n, generator=gen).to(torch.bfloat16)
    grads = [torch.randn(n, generator=gen).to(torch.bfloat16) for _ in range(steps)]
    kw = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay)
    ref = _adam_steps(torch.optim.AdamW, p0.double(), [g.double() for g in grads], **kw)
    got = _adam_steps(StochasticRoundingAdamW, p0, grads, **kw).double()
    moved = (ref - p0.double()).abs().mean()
    assert moved > 0.05  # large updates: a wrong formula would be far off
    # per element: a few bf16 steps (2^-8 relative) of rounding noise after eight steps
    assert ((got - ref).abs() <= 2**-5 * (ref.abs() + 0.1)).all()
    # the update itself: regressing got's displacement on the reference's gives slope 1 (a missing
    # bias correction or a wrong beta scales it by ~0.9 here)
    d_ref, d_got = ref - p0.double(), got - p0.double()
    # measured 3.0e-03: 3.3x margin (a wrong beta gives ~0.9)
    assert float((d_got * d_ref).sum() / (d_ref * d_ref).sum()) == pytest.approx(1.0, abs=0.01)


def test_eps_enters_like_torch_when_the_second_moment_is_tiny():
    """Gradients ~1e-4 with eps 1e-4: sqrt(v) ~ eps, so where eps enters changes the update."""
    gen = torch.Generator().manual_seed(3)
    n, steps = 4096, 6
    p0 = torch.randn(n, generator=gen).to(torch.bfloat16)
    grads = [(1e-4 * torch.randn(n, generator=gen)).to(torch.bfloat16) for _ in range(steps)]
    kw = dict(lr=3e-2, betas=(0.9, 0.999), eps=1e-4, weight_decay=0.0)
    ref = _adam_steps(torch.optim.AdamW, p0.double(), [g.double() for g in grads], **kw)
    got = _adam_steps(StochasticRoundingAdamW, p0, grads, **kw).double()
    d_ref, d_got = ref - p0.double(), got - p0.double()
    # measured 4.2e-03: 2.4x margin
    assert float((d_got * d_ref).sum() / (d_ref * d_ref).sum()) == pytest.approx(1.0, abs=0.01)


def test_second_moment_keeps_its_small_increments():
    """beta2 = 0.999: late increments of exp_avg_sq are ~1e-3 relative, below bf16's half step."""
    n, steps = 8192, 1500
    p = torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16))
    opt = StochasticRoundingAdamW([p], lr=1e-6, betas=(0.9, 0.999))
    g = torch.full((n,), 0.5, dtype=torch.bfloat16)
    for _ in range(steps):
        p.grad = g
        opt.step()
    want = (1 - 0.999**steps) * 0.25  # exact exp_avg_sq under a constant gradient
    got = float(opt.state[p]["exp_avg_sq"].double().mean())
    # measured rel 1.5e-04: 7x margin (round-to-nearest is ~60% off)
    assert got == pytest.approx(want, rel=1e-3)  # round-to-nearest stalls near 0.4 x 0.25


def test_state_is_bf16_and_resumes_with_the_same_random_bits():
    gen = torch.Generator().manual_seed(2)
    p0 = torch.randn(1000, generator=gen).to(torch.bfloat16)
    grads = [torch.randn(1000, generator=gen) for _ in range(4)]
    straight = torch.nn.Parameter(p0.clone())
    opt = StochasticRoundingAdamW([straight], lr=1e-3)
    for g in grads:
        straight.grad = g.to(torch.bfloat16)
        opt.step()
    assert {k: v.dtype for k, v in opt.state[straight].items()} == {
        "step": torch.float32, "exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16,
    }  # fmt: skip
    first = torch.nn.Parameter(p0.clone())
    opt1 = StochasticRoundingAdamW([first], lr=1e-3)
    for g in grads[:2]:
        first.grad = g.to(torch.bfloat16)
        opt1.step()
    resumed = torch.nn.Parameter(first.detach().clone())
    opt2 = StochasticRoundingAdamW([resumed], lr=1e-3)
    opt2.load_state_dict(opt1.state_dict())
    for g in grads[2:]:
        resumed.grad = g.to(torch.bfloat16)
        opt2.step()
    assert torch.equal(resumed, straight)  # per-step seeding: no RNG state to save
    with pytest.raises(TypeError, match="bf16 parameters"):
        StochasticRoundingAdamW([torch.nn.Parameter(torch.ones(2))])


def test_compiled_update_equals_eager(monkeypatch):
    """actor.compile's fused update (torch.compile, dynamic shapes) takes the eager steps bit for bit on the CPU,
    through changing learning rates, several shapes and chunked parameters."""
    monkeypatch.setattr(optim_module, "CHUNK", 1000)  # the (96, 33) parameter is cut into 4 chunks

    def run(compiled: bool) -> tuple[list[torch.Tensor], StochasticRoundingAdamW]:
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(*s, generator=gen).bfloat16()) for s in ((700,), (96, 33), (5,))]
        opt = StochasticRoundingAdamW(params, lr=1e-2, weight_decay=0.1, compiled=compiled)
        for lr in (1e-2, 5e-3, 2e-3):
            opt.param_groups[0]["lr"] = lr
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).bfloat16()
            opt.step()
        return params, opt

    (eager, eager_opt), (fused, fused_opt) = run(False), run(True)
    for a, b in zip(eager, fused, strict=True):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(eager_opt.state[a][key], fused_opt.state[b][key])


def test_build_optimizer_follows_master_dtype():
    p = [torch.nn.Parameter(torch.ones(2))]
    assert type(build_optimizer(p, ActorSection(), fused=False)) is torch.optim.AdamW
    pb = [torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))]
    opt = build_optimizer(pb, ActorSection(master_dtype="bfloat16"), fused=False)
    assert isinstance(opt, StochasticRoundingAdamW) and opt.update is optim_module._adamw_update
    compiled = build_optimizer(pb, ActorSection(master_dtype="bfloat16", compile=True), fused=False)
    assert compiled.update is not optim_module._adamw_update  # actor.compile fuses the update too


def test_config_rejects_bf16_master_without_bf16_compute_or_on_megatron():
    with pytest.raises(ValueError, match="model.dtype=bfloat16"):
        Config(actor=ActorSection(master_dtype="bfloat16"))
    cfg = Config()
    cfg.model.dtype = "bfloat16"
    with pytest.raises(ValueError, match="megatron"):
        Config(model=cfg.model, actor=ActorSection(master_dtype="bfloat16", backend="megatron"))
    Config(model=cfg.model, actor=ActorSection(master_dtype="bfloat16", backend="fsdp"))  # accepted
    with pytest.raises(ValueError, match="master_dtype"):
        build_engine(make_model(), CPU, torch.float32, 1.0, ActorSection(master_dtype="bfloat16"))


# ---------------------------------------------------------------- engines



def _training_bytes(engine) -> tuple[int, int]:
    """(bytes of parameters + gradients + AdamW moments, parameter count) of an engine's local shards."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    total, count = 0, 0
    for p in engine.model.parameters():
        count += local(p).numel()
        total += local(p).nbytes + local(p.grad).nbytes
        state = engine.optimizer.state[p]
        total += local(state["exp_avg"]).nbytes + local(state["exp_avg_sq"]).nbytes
    return total, count


def _one_step_keep_grads(engine) -> None:
    mbs, _ = local_micro_batches(BATCHES[0](), CAP)
    engine.forward_backward(mbs, LOSSES[0], max_response_len=16)
    engine.optimizer.step()  # engine.optim_step would drop the gradients


@pytest.mark.parametrize("backend", ["local", "fsdp"])
def test_engine_holds_8_bytes_per_parameter_and_trains_like_fp32(pg, backend):
    cls = LocalEngine if backend == "local" else FSDPEngine
    bf16 = cls(make_model(), CPU, torch.bfloat16, 1.0, BF16_ACTOR)
    fp32 = cls(make_model(), CPU, torch.bfloat16, 1.0, ACTOR)
    _one_step_keep_grads(bf16)
    _one_step_keep_grads(fp32)
    nbytes, count = _training_bytes(bf16)
    assert nbytes == 8 * count
    assert _training_bytes(fp32)[0] == 16 * count
    # the next steps: the same losses and gradient norms up to bf16 rounding of the weights
    got, want = run_steps(bf16), run_steps(fp32)
    for g, w in zip(got, want, strict=True):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            # measured max |diff| 1.1e-02 (rel 5.3e-03, on grad norms ~2): 2x margin
            assert g[key] == pytest.approx(w[key], rel=0.01, abs=1e-3), key
    got_w = {k: v.float() for k, v in bf16.export_weights()}
    want_w = {k: v.float() for k, v in fp32.export_weights()}
    # the stochastically rounded weight sits one or two bf16 steps (2^-7 at |w| ~ 1: the norm weights)
    # from the fp32 one: measured max |diff| 1.36e-02, 1.5x margin
    assert_weights_close(got_w, want_w, atol=0.02)
    # As a whole, the bf16 run made the fp32 run's update: |W_bf16 - W_fp32| / |W_fp32 - W_0| measured
    # 0.105 (local and fsdp); 1.4x margin. Dropped small updates (round-to-nearest) would leave ~1.
    init = {k: v.float() for k, v in hf.to_hf_state_dict(make_model().state_dict()).items()}
    dist = sum(float((got_w[k] - want_w[k]).square().sum()) for k in want_w) ** 0.5
    update = sum(float((want_w[k] - init[k]).square().sum()) for k in want_w) ** 0.5
    assert dist < 0.15 * update, (dist, update)


def test_fsdp_bf16_master_matches_local(pg):
    """World size 1: FSDP's bf16 shards take the same steps (and random bits) as the local engine's."""
    local = LocalEngine(make_model(), CPU, torch.bfloat16, 1.0, BF16_ACTOR)
    fsdp = FSDPEngine(make_model(), CPU, torch.bfloat16, 1.0, BF16_ACTOR)
    got, want = run_steps(fsdp), run_steps(local)
    # measured 0 for every metric and weight: the same arithmetic and random bits, so exact
    assert [{k: m[k] for k in METRICS} for m in got] == [{k: m[k] for k in METRICS} for m in want]
    # measured max |diff| 0 (the earlier atol 2e-2 hid nothing): exact
    assert_weights_close(dict(fsdp.export_weights()), dict(local.export_weights()), atol=0.0)


def test_bf16_grad_norm_and_clipping_are_fp32(pg):
    """The logged norm and the clip factor come from an fp32 sum of squares, not a bf16 result."""
    for cls in (LocalEngine, FSDPEngine):
        engine = cls(make_model(), CPU, torch.bfloat16, 1.0, BF16_ACTOR)
        mbs, _ = local_micro_batches(BATCHES[0](), CAP)
        engine.forward_backward(mbs, LOSSES[0], max_response_len=16)
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in engine.model.parameters()]
        want = float(torch.cat([g.double().flatten() for g in grads]).norm())
        got = engine._clip_grad_norm(0.5 * want)
        # measured rel 1.5e-07: 7x margin
        assert got == pytest.approx(want, rel=1e-6)  # a bf16 result would be off by up to 4e-3
        clipped = float(torch.cat([g.double().flatten() for g in grads]).norm())
        # measured 0 here; 4e-3 ~ bf16's relative rounding 2^-8, the bound when the multiply rounds
        assert clipped == pytest.approx(0.5 * want, rel=4e-3)  # bf16 gradients after the multiply
