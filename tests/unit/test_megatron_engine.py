"""MegatronEngine on the CPU against LocalEngine: log-probs, one training step, a loss curve, resume.

megatron-core's DDP, distributed optimizer and forward-backward schedule run unmodified on the
CPU (the engine enters slipstream/engine/megatron/cpu_compat.py around its calls there). The
training-step tests are what would catch the "Megatron grad norm ~3x FSDP" bug: the schedule
dividing by the number of micro-batches, or finalize_model_grads by the token count, changes
grad_norm and the updated weights at once.
"""

from __future__ import annotations

import dataclasses
import math

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("megatron.core")

from megatron_cpu import reset_megatron, set_rank_env  # noqa: E402

from engine_checks import assert_weights_close  # noqa: E402
from slipstream.algo.losses import AGG_MODES, LossSpec, SpecLoss  # noqa: E402
from slipstream.batching.packing import pack_samples  # noqa: E402
from slipstream.batching.records import PackedBatch, Sample  # noqa: E402
from slipstream.config.schema import ActorSection, Config, MegatronLayout, parse_backend  # noqa: E402
from slipstream.engine.distributed import free_port, init_distributed  # noqa: E402
from slipstream.batching.shard import local_micro_batches
from slipstream.engine.factory import build_engine  # noqa: E402
from slipstream.engine.local import LocalEngine  # noqa: E402
from slipstream.models.presets import get_preset  # noqa: E402
from slipstream.models.transformer import Transformer  # noqa: E402
from slipstream.ops.logprobs import linear_logprobs  # noqa: E402

CPU = torch.device("cpu")
ACTOR = ActorSection(lr=1e-3, eps=1e-4, grad_clip=1.0, max_tokens_per_mb=1024)
METRICS = ("actor/pg_loss", "actor/entropy", "actor/kl", "actor/num_loss_tokens", "actor/grad_norm", "actor/lr")


Loss = SpecLoss  # the engines' LossFn over a LossSpec (needs_entropy=True)


def make_batch(num_seqs: int, seed: int) -> PackedBatch:
    """Random prompts / responses with old and ref log-probs spread so that ratios clip and KL is non-zero."""
    gen = torch.Generator().manual_seed(seed)
    vocab = get_preset("tiny").vocab_size
    samples = []
    for i in range(num_seqs):
        p, r = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(1, 12, (1,), generator=gen))
        samples.append(Sample(
            prompt_ids=tuple(torch.randint(3, vocab, (p,), generator=gen).tolist()),
            response_ids=tuple(torch.randint(3, vocab, (r,), generator=gen).tolist()),
            behav_logprobs=(-4.5,) * r,
            group_id=i // 2,
        ))  # fmt: skip
    batch = pack_samples(samples, torch.randn(num_seqs, generator=gen))
    t = batch.num_tokens
    return batch.with_(old_logprobs=-4.5 + 0.2 * torch.randn(t, generator=gen),
                       ref_logprobs=-4.5 + 0.2 * torch.randn(t, generator=gen))  # fmt: skip


def make_model(preset: str = "tiny", seed: int = 0, sharp: bool = False) -> Transformer:
    """Initialised tiny model; `sharp` scales weights up so attention is far from uniform."""
    model = Transformer(get_preset(preset))
    model.init_weights(seed)
    if sharp:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                noise = torch.randn(p.shape, generator=gen)
                p.copy_(1 + 0.1 * noise if "norm" in name else 0.2 * noise)
    return model


def split(batch: PackedBatch, num_micro_batches: int) -> list[PackedBatch]:
    """The planner's micro-batches under the largest cap that yields `num_micro_batches`."""
    for cap in range(batch.num_tokens, 0, -1):
        mbs, _ = local_micro_batches(batch, cap)
        if len(mbs) == num_micro_batches:
            return mbs
    raise AssertionError(f"no cap splits the batch into {num_micro_batches} micro-batches")


def megatron_engine(
    preset: str = "tiny", actor: ActorSection | None = ACTOR, seed: int = 0, sharp: bool = False, **kwargs
):
    from slipstream.engine.megatron.engine import MegatronEngine

    return MegatronEngine(make_model(preset, seed, sharp), CPU, torch.float32, 1.0, actor, **kwargs)


@pytest.fixture(scope="module", autouse=True)
def megatron_cpu():
    """One CPU thread, and a 1-process gloo group + megatron parallel state torn down at the end."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    init_distributed("cpu")
    yield
    reset_megatron()
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])  # tied and untied LM head
def test_logprobs_match_local_on_packed_batches(preset):
    batch = make_batch(8, 1)
    mbs = split(batch, 2)
    assert min(mb.num_seqs for mb in mbs) >= 3  # several sequences share each micro-batch
    got = megatron_engine(preset, actor=None, sharp=True).forward_logprobs(mbs, with_entropy=True)
    local = LocalEngine(make_model(preset, sharp=True), CPU, torch.float32, 1.0)
    want = local.forward_logprobs(mbs, with_entropy=True)
    for g, w in zip(got, want, strict=True):
        # measured 0 (bit-identical on the CPU): exact
        torch.testing.assert_close(g.logprobs, w.logprobs, atol=0, rtol=0)
        # measured 0 (bit-identical on the CPU): exact
        torch.testing.assert_close(g.entropy, w.entropy, atol=0, rtol=0)
    # Negative control: the comparison is sensitive to RoPE positions (doubled relative distances
    # change the log-probs). A constant offset per sequence would not be seen (RoPE is relative),
    # so Megatron's THD RoPE, which rotates each cu_seqlens segment from 0, is correct here.
    mb = mbs[0]
    stretched = local.forward_logprobs([mb.with_(position_ids=2 * mb.position_ids)])[0].logprobs
    assert (stretched - want[0].logprobs).abs().max() > 1e-3


def test_megatron_elementwise_fusions_give_local_steps():
    """Megatron's fused SwiGLU / residual add (torch.compile'd, on by default on the GPU) against
    LocalEngine for 3 steps with changing packed shapes and full recompute."""
    loss = Loss(LossSpec(kl_coef=0.1, entropy_coef=0.01))
    local = LocalEngine(make_model(), CPU, torch.float32, 1.0, ACTOR)
    engine = megatron_engine(actor=dataclasses.replace(ACTOR, activation_checkpointing="full"), fuse_elementwise=True)
    assert engine.gpt.config.bias_activation_fusion and engine.gpt.config.bias_dropout_fusion
    assert not megatron_engine(actor=None).gpt.config.bias_activation_fusion  # CPU default: off
    for step in range(3):
        mbs = split(make_batch(6 + step, step), 1 + step % 2)
        want = local.forward_backward(mbs, loss, max_response_len=16) | local.optim_step()
        got = engine.forward_backward(mbs, loss, max_response_len=16) | engine.optim_step()
        for key in METRICS:
            # measured max |diff| 1.4e-07 (rel 2.5e-07): 4x margin
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-6), (step, key)
    # measured max |diff| 1.2e-07: 8x margin
    assert_weights_close(dict(engine.export_weights()), dict(local.export_weights()), atol=1e-6)


def test_bf16_model_holds_every_parameter_in_bf16():
    """Megatron's Float16Module convention: no fp32 norm weight left beside bf16 activations.

    The local spec builds its RMSNorms (layer, q/k, final) in fp32; kept so, torch.rms_norm takes
    its unfused upcast path on the GPU and DDP keeps a second (fp32) gradient bucket.
    """
    from slipstream.engine.megatron.engine import MegatronEngine

    engine = MegatronEngine(make_model("tiny", 0, sharp=True), CPU, torch.bfloat16, 1.0, ACTOR)
    odd = {n: p.dtype for n, p in engine.gpt.named_parameters() if p.dtype != torch.bfloat16}
    assert not odd, odd
    # Every parameter is in the optimizer's float16 groups, and each fp32 master shard equals the
    # caller's fp32 weights (converted to Megatron layout), not the bf16 model parameter's rounding.
    from slipstream.engine.megatron import provider
    from slipstream.models import hf

    opt = engine.optimizer
    opt = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt  # one dtype: one optimizer
    assert sum(len(g) for g in opt.model_fp32_groups) == 0
    hf_weights = hf.to_hf_state_dict(make_model("tiny", 0, sharp=True).state_dict())
    source = provider.megatron_shard(engine.gpt, hf_weights, engine.cfg)
    names = {p: n for n, p in engine.gpt.named_parameters()}
    rounded_somewhere = False
    for model_group, shard_group in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups, strict=True):
        for param, shard in zip(model_group, shard_group, strict=True):
            r = opt._get_model_param_range_map(param)["param"]
            want = source[names[param].removeprefix("module.")].float().reshape(-1)[r.start : r.end]
            # exact: the fp32 masters are the caller's fp32 weights (measured 0)
            torch.testing.assert_close(shard, want, atol=0, rtol=0)
            rounded_somewhere |= bool((shard != param.detach().float().reshape(-1)[r.start : r.end]).any())
    assert rounded_somewhere  # the bf16 params really are a rounding of the fp32 masters
    mbs = split(make_batch(6, 2), 2)
    loss = Loss(LossSpec(kl_coef=0.1))
    metrics = engine.forward_backward(mbs, loss, max_response_len=16) | engine.optim_step()
    assert math.isfinite(metrics["actor/grad_norm"]) and metrics["actor/grad_norm"] > 0


# ---------------------------------------------------------------- training step


@pytest.mark.parametrize("num_mbs", [1, 3])
@pytest.mark.parametrize("agg_mode", sorted(AGG_MODES))
def test_one_step_matches_local(agg_mode, num_mbs):
    loss = Loss(LossSpec(agg_mode=agg_mode, kl_coef=0.1, entropy_coef=0.01, clip_low=0.1, clip_high=0.1))
    mbs = split(make_batch(6, 2), num_mbs)
    local = LocalEngine(make_model(), CPU, torch.float32, 1.0, ACTOR)
    engine = megatron_engine()
    want = local.forward_backward(mbs, loss, max_response_len=16) | local.optim_step()
    got = engine.forward_backward(mbs, loss, max_response_len=16) | engine.optim_step()
    assert got.keys() == want.keys()
    for key in METRICS:
        # measured max |diff| 1.6e-07: 6x margin
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-6), key
    assert got["actor/num_micro_batches"] == num_mbs
    # A division by num_microbatches (or by the token count) would scale grad_norm and move the weights.
    # measured max |diff| 1.2e-07: 8x margin
    assert_weights_close(dict(engine.export_weights()), dict(local.export_weights()), atol=1e-6)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_gives_the_same_step(mode):
    loss = Loss(LossSpec(kl_coef=0.1, entropy_coef=0.01))
    mbs = split(make_batch(6, 3), 2)
    plain = megatron_engine()
    again = megatron_engine(actor=dataclasses.replace(ACTOR, activation_checkpointing=mode))
    assert again.gpt.config.recompute_granularity == mode
    want = plain.forward_backward(mbs, loss, max_response_len=16) | plain.optim_step()
    got = again.forward_backward(mbs, loss, max_response_len=16) | again.optim_step()
    for key in METRICS:
        # measured 0 (bit-identical on the CPU): exact
        assert got[key] == pytest.approx(want[key], rel=0, abs=0), key
    # measured 0 (bit-identical on the CPU): exact
    assert_weights_close(dict(again.export_weights()), dict(plain.export_weights()), atol=0.0)


def test_five_step_loss_curve_with_warmup():
    actor = ActorSection(lr=1e-3, eps=1e-4, grad_clip=1.0, warmup_steps=3)
    local = LocalEngine(make_model(), CPU, torch.float32, 1.0, actor)
    engine = megatron_engine(actor=actor)
    loss = Loss(LossSpec(kl_coef=0.05))
    curves = {"local": [], "megatron": []}
    for step in range(5):
        mbs = split(make_batch(6, 10 + step), 2)
        for name, eng in (("local", local), ("megatron", engine)):
            curves[name].append(eng.forward_backward(mbs, loss, max_response_len=16) | eng.optim_step())
    # exact arithmetic (warm-up schedule): measured 0
    assert [m["actor/lr"] for m in curves["megatron"]] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3, 1e-3])
    for got, want in zip(curves["megatron"], curves["local"], strict=True):
        for key in METRICS:
            # measured max |diff| 5.7e-07 (rel 4.4e-07): 3.5x margin
            assert got[key] == pytest.approx(want[key], rel=2e-6, abs=2e-6), key
    # must differ: measured |diff| 0.81 against approx's default rel 1e-6
    assert curves["local"][0]["actor/pg_loss"] != pytest.approx(curves["local"][-1]["actor/pg_loss"])


def test_nonfinite_grad_skips_the_step():
    engine = megatron_engine()
    before = dict(engine.export_weights())
    mbs = split(make_batch(4, 3), 1)
    loss = Loss(LossSpec())

    def nan_loss(logprobs, entropy, batch, norm):
        value, metrics = loss(logprobs, entropy, batch, norm)
        return value * float("nan"), metrics

    nan_loss.needs_entropy = True
    engine.forward_backward(mbs, nan_loss, max_response_len=16)
    out = engine.optim_step()
    assert out["actor/step_skipped"] == 1.0 and engine.num_steps == 0
    # exact: a skipped step leaves the weights untouched (measured 0)
    assert_weights_close(dict(engine.export_weights()), before, atol=0.0)
    # the NaN gradients were dropped: the next step is a normal one
    engine.forward_backward(mbs, loss, max_response_len=16)
    assert engine.optim_step()["actor/step_skipped"] == 0.0


def test_save_load_resumes_exactly(tmp_path: Path):
    loss = Loss(LossSpec(kl_coef=0.1))
    first = megatron_engine()
    first_mbs, next_mbs = split(make_batch(6, 4), 2), split(make_batch(6, 5), 3)
    first.forward_backward(first_mbs, loss, max_response_len=16)
    first.optim_step()
    first.save(tmp_path)
    resumed = megatron_engine(seed=7)
    resumed.load(tmp_path)
    want = first.forward_backward(next_mbs, loss, max_response_len=16) | first.optim_step()
    got = resumed.forward_backward(next_mbs, loss, max_response_len=16) | resumed.optim_step()
    assert got == want
    got_w, want_w = dict(resumed.export_weights()), dict(first.export_weights())
    # exact: resume is bit-identical (measured 0)
    assert_weights_close(got_w, want_w, atol=0.0)
    # a checkpoint written by another number of ranks is refused with the layouts named
    (first._rank_file(tmp_path).parent / "rank00001.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="megatron checkpoint of 2 ranks; this engine has 1"):
        resumed.load(tmp_path)


# ---------------------------------------------------------------- backend selection


def test_backend_strings():
    assert parse_backend("megatron") == ("megatron", MegatronLayout())
    assert parse_backend("megatron:d1t1p1c1") == ("megatron", MegatronLayout(dp=1))
    assert parse_backend("megatron:t2c2") == ("megatron", MegatronLayout(tp=2, cp=2))
    assert parse_backend("fsdp") == ("fsdp", None)
    assert MegatronLayout(tp=2).data_parallel_size(8) == 4
    bad = {
        "megatron:": "expected megatron:d<D>",
        "megatron:t2d1": "letters in that order",
        "megatron:t0": ">= 1",
        "megatron:x2": "expected megatron:d<D>",
        "fsdp:t2": "takes no parallel sizes",
        "megatrom": "did you mean 'megatron'",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message):
            Config(actor=ActorSection(backend=text))
    with pytest.raises(ValueError, match="not divisible"):
        MegatronLayout(tp=3).data_parallel_size(8)
    with pytest.raises(ValueError, match="asks for d2"):
        MegatronLayout(dp=2, tp=2).data_parallel_size(8)


def test_build_engine_selects_megatron():
    from slipstream.engine.megatron.engine import MegatronEngine

    for backend in ("megatron", "megatron:d1t1p1c1"):
        engine = build_engine(make_model(), CPU, torch.float32, 1.0, ActorSection(backend=backend))
        assert isinstance(engine, MegatronEngine) and engine.optimizer is not None
    ref = build_engine(make_model(), CPU, torch.float32, 1.0, ActorSection(backend="megatron"), forward_only=True)
    assert isinstance(ref, MegatronEngine) and ref.optimizer is None
    assert not any(p.requires_grad for p in ref.model.parameters())
    with pytest.raises(ValueError, match="asks for d2"):  # one process cannot hold d2
        build_engine(make_model(), CPU, torch.float32, 1.0, ActorSection(backend="megatron:d2"))
    with pytest.raises(ValueError, match="pipeline"):
        build_engine(make_model(), CPU, torch.float32, 1.0, ActorSection(backend="megatron:p2"))


# ---------------------------------------------------------------- two ranks


def _vocab_parallel_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Rank r holds vocab rows [r*V/2, (r+1)*V/2); returns its log-probs, entropy and gradients."""
    from slipstream.engine.megatron.vocab_parallel import vocab_parallel_logprobs

    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    try:
        hidden, weight, targets, g_lp, g_ent = _vocab_case()
        shard = weight.chunk(world)[rank].detach().clone().requires_grad_()
        h = hidden.clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs(
            h, shard, targets, vocab_start=rank * shard.shape[0], group=torch.distributed.group.WORLD,
            temperature=0.7, with_entropy=True, chunk_size=5,
        )  # fmt: skip
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        torch.save({"lp": lp.detach(), "ent": ent.detach(), "g_h": h.grad, "g_w": shard.grad},
                   Path(out_dir) / f"vp{rank}.pt")  # fmt: skip
    finally:
        torch.distributed.destroy_process_group()


def _vocab_case():
    """fp32 hidden (T, H), weight (V, H), targets and upstream gradients of log-prob and entropy."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, 8, generator=gen)
    weight = torch.randn(10, 8, generator=gen)
    targets = torch.randint(0, 10, (13,), generator=gen)
    return hidden, weight, targets, torch.randn(13, generator=gen), torch.randn(13, generator=gen)


def test_vocab_parallel_logprobs_two_ranks(tmp_path: Path):
    mp.spawn(_vocab_parallel_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    hidden, weight, targets, g_lp, g_ent = _vocab_case()
    # reference 1: the single-process fused op; reference 2: plain float64 autograd
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = linear_logprobs(h, w, targets, temperature=0.7, with_entropy=True, impl="torch")
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logp = torch.log_softmax(h64 @ w64.T / 0.7, dim=-1)
    lp64, ent64 = logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)
    ((lp64 * g_lp.double()).sum() + (ent64 * g_ent.double()).sum()).backward()
    results = [torch.load(tmp_path / f"vp{r}.pt") for r in range(2)]
    g_w = torch.cat([r["g_w"] for r in results])
    for want_lp, want_ent, want_gh, want_gw in ((lp, ent, h.grad, w.grad), (lp64, ent64, h64.grad, w64.grad)):
        for res in results:  # values and the hidden-state gradient are complete on every rank
            # measured max |diff| 9.5e-07 (vs fp32 and float64): 2x margin
            torch.testing.assert_close(res["lp"], want_lp.detach().float(), atol=2e-6, rtol=0)
            # measured max |diff| 3.5e-06: 3x margin
            torch.testing.assert_close(res["ent"], want_ent.detach().float(), atol=1e-5, rtol=0)
            # measured max |diff| 6.5e-06: 3x margin
            torch.testing.assert_close(res["g_h"], want_gh.float(), atol=2e-5, rtol=0)
        # measured max |diff| 9.7e-06 (the float64 reference): 2x margin
        torch.testing.assert_close(g_w, want_gw.float(), atol=2e-5, rtol=0)


def _two_rank_dp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """megatron:d2 -- DDP reduce-scatter, the distributed optimizer and the DP count all-reduce over gloo."""
    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    try:
        engine = megatron_engine(layout=MegatronLayout(dp=2))
        metrics = []
        for seed, loss in ((20, Loss(LossSpec(kl_coef=0.1))), (21, Loss(LossSpec(agg_mode="seq-mean-token-mean")))):
            mbs, _ = local_micro_batches(make_batch(7, seed), 24, rank=engine.dp_rank, world=engine.dp_size)
            metrics.append(engine.forward_backward(mbs, loss, max_response_len=16) | engine.optim_step())
        torch.save({"metrics": metrics, "weights": dict(engine.export_weights())}, Path(out_dir) / f"dp{rank}.pt")
    finally:
        reset_megatron()


def test_two_dp_ranks_match_one_process(tmp_path: Path):
    mp.spawn(_two_rank_dp_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    local = LocalEngine(make_model(), CPU, torch.float32, 1.0, ACTOR)
    want = []
    for seed, loss in ((20, Loss(LossSpec(kl_coef=0.1))), (21, Loss(LossSpec(agg_mode="seq-mean-token-mean")))):
        mbs, _ = local_micro_batches(make_batch(7, seed), 24)
        want.append(local.forward_backward(mbs, loss, max_response_len=16) | local.optim_step())
    for rank in range(2):
        res = torch.load(tmp_path / f"dp{rank}.pt")
        for got, exp in zip(res["metrics"], want, strict=True):
            for key in METRICS:
                # measured max |diff| 4.8e-07 (rel 2.3e-07): 2x margin
                assert got[key] == pytest.approx(exp[key], rel=1e-6, abs=1e-6), (rank, key)
        # measured max |diff| 1.2e-07: 8x margin
        assert_weights_close(res["weights"], dict(local.export_weights()), atol=1e-6)


def _two_rank_tp_worker(rank: int, world: int, port: int, out_dir: str, preset: str) -> None:
    """megatron:t2 -- every weight sharded over two TP ranks that see the same micro-batches."""
    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    try:
        engine = megatron_engine(preset, layout=MegatronLayout(tp=2))
        assert (engine.tp_size, engine.dp_size) == (2, 1)
        mbs = split(make_batch(6, 2), 2)
        logprobs = [o.logprobs for o in engine.forward_logprobs(mbs)]
        metrics = engine.forward_backward(mbs, TP_LOSS, max_response_len=16) | engine.optim_step()
        torch.save({"logprobs": logprobs, "metrics": metrics, "weights": dict(engine.export_weights())},
                   Path(out_dir) / f"tp{rank}.pt")  # fmt: skip
    finally:
        reset_megatron()


TP_LOSS = Loss(LossSpec(kl_coef=0.1, entropy_coef=0.01))


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])  # tied and untied LM head
def test_two_tp_ranks_match_one_process(tmp_path: Path, preset: str):
    # Fails when TP shards are left unflagged (the grad norm then drops TP rank 1's shards and the
    # clip coefficient is wrong) or when the sharded master weights are not contiguous (crash).
    mp.spawn(_two_rank_tp_worker, args=(2, free_port(), str(tmp_path), preset), nprocs=2, join=True)
    local = LocalEngine(make_model(preset), CPU, torch.float32, 1.0, ACTOR)
    mbs = split(make_batch(6, 2), 2)
    want_lp = [o.logprobs for o in local.forward_logprobs(mbs)]
    want = local.forward_backward(mbs, TP_LOSS, max_response_len=16) | local.optim_step()
    for rank in range(2):
        res = torch.load(tmp_path / f"tp{rank}.pt")
        for got, exp in zip(res["logprobs"], want_lp, strict=True):
            # measured max |diff| 9.5e-07: 2x margin
            torch.testing.assert_close(got, exp, atol=2e-6, rtol=0)
        for key in METRICS:
            # measured max |diff| 1.2e-07: 8x margin
            assert res["metrics"][key] == pytest.approx(want[key], rel=1e-6, abs=1e-6), (rank, key)
        # measured max |diff| 3.9e-08: 5x margin
        assert_weights_close(res["weights"], dict(local.export_weights()), atol=2e-7)
