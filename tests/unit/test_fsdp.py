"""CPU (gloo) tests of the FSDP2 backend against the single-device LocalEngine.

The key test runs two ranks (torch.multiprocessing spawn) on a global batch split by the
planner and checks loss metrics, grad norm and updated weights against one process: it only
passes when every rank divides by the global token / sequence counts and gradients are summed.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from engine_checks import assert_weights_close
from slipstream.algo.losses import LossSpec, SpecLoss
from slipstream.batching.packing import pack_samples
from slipstream.batching.records import PackedBatch, Sample
from slipstream.config.schema import ActorSection
from slipstream.engine.distributed import destroy_distributed, free_port
from slipstream.batching.shard import local_micro_batches
from slipstream.engine.distributed import gather_per_token
from slipstream.engine.factory import build_engine
from slipstream.engine.fsdp import FSDPEngine
from slipstream.engine.local import LocalEngine
from slipstream.models.parallelize import parallelize
from slipstream.models.presets import get_preset
from slipstream.models.transformer import Transformer

CPU = torch.device("cpu")
CAP = 24  # tokens per micro-batch: several micro-batches per minibatch
# eps large enough that Adam's update is a smooth function of the gradient, so fp32 summation
# order differences (1e-7) cannot flip the sign of a near-zero update.
ACTOR = ActorSection(lr=1e-3, eps=1e-4, grad_clip=1.0, max_tokens_per_mb=CAP)
METRICS = ("actor/pg_loss", "actor/entropy", "actor/clip_frac", "actor/num_loss_tokens", "actor/grad_norm")


Loss = SpecLoss  # the engines' LossFn over a LossSpec (needs_entropy=True)


# token-mean exercises num_loss_tokens, seq-mean-token-mean num_seqs; KL and clipping on the second.
LOSSES = (
    Loss(LossSpec(entropy_coef=0.01)),
    Loss(LossSpec(agg_mode="seq-mean-token-mean", kl_coef=0.1, clip_low=0.1, clip_high=0.1)),
    Loss(LossSpec()),
)


def make_batch(num_seqs: int, seed: int, with_old_ref: bool = False) -> PackedBatch:
    gen = torch.Generator().manual_seed(seed)
    vocab = get_preset("tiny").vocab_size  # same vocabulary in tiny and tiny-llama
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
    if with_old_ref:  # log-probs of a near-uniform small-vocab model; spread them so ratios clip
        t = batch.num_tokens
        batch = batch.with_(old_logprobs=-4.5 + 0.2 * torch.randn(t, generator=gen),
                            ref_logprobs=-4.5 + 0.2 * torch.randn(t, generator=gen))  # fmt: skip
    return batch


BATCHES = (lambda: make_batch(8, 1), lambda: make_batch(8, 2, with_old_ref=True), lambda: make_batch(1, 3))


def make_model(preset: str = "tiny", seed: int = 0) -> Transformer:
    model = Transformer(get_preset(preset))
    model.init_weights(seed)
    return model


def run_steps(engine, rank: int = 0, world: int = 1, steps: int = 3) -> list[dict[str, float]]:
    """One minibatch + optimizer step per (batch, loss) pair, on this rank's share of the plan."""
    out = []
    for make, loss in list(zip(BATCHES, LOSSES))[:steps]:
        mbs, _ = local_micro_batches(make(), CAP, rank=rank, world=world)
        metrics = engine.forward_backward(mbs, loss, max_response_len=16)
        metrics.update(engine.optim_step())
        out.append(metrics)
    return out


# callers pass `atol` (used as abs and rel) with their measured max |diff| beside it
def assert_metrics_close(got: list[dict], want: list[dict], atol: float) -> None:
    for g, w in zip(got, want, strict=True):
        for key in METRICS:
            # the caller's tolerance (measured value stated at the call)
            assert g[key] == pytest.approx(w[key], abs=atol, rel=atol), key


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny shapes on shared cores: intra-op threads only add contention."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def local_ref():
    """LocalEngine after the three reference steps (metrics, weights, and the engine itself)."""
    engine = LocalEngine(make_model(), CPU, torch.float32, 1.0, ACTOR)
    metrics = run_steps(engine)
    return metrics, dict(engine.export_weights()), engine


# ---------------------------------------------------------------- world size 1


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])  # tied and untied LM head
def test_world1_matches_local(pg, preset):
    local = LocalEngine(make_model(preset), CPU, torch.float32, 1.0, ACTOR)
    fsdp = FSDPEngine(make_model(preset), CPU, torch.float32, 1.0, ACTOR)
    want, got = run_steps(local, steps=2), run_steps(fsdp, steps=2)
    # measured 0 (bit-identical on the CPU): exact
    assert_metrics_close(got, want, atol=0.0)
    assert want[0]["actor/grad_norm"] > ACTOR.grad_clip  # clipping is active in this test
    # measured 0 (bit-identical on the CPU): exact
    assert_weights_close(dict(fsdp.export_weights()), dict(local.export_weights()), atol=0.0)
    # forward-only log-probs agree too
    mbs, _ = local_micro_batches(make_batch(8, 1), CAP)
    for a, b in zip(fsdp.forward_logprobs(mbs, with_entropy=True), local.forward_logprobs(mbs, with_entropy=True)):
        # measured 0 (bit-identical on the CPU): exact
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=0, rtol=0)
        # measured 0 (bit-identical on the CPU): exact
        torch.testing.assert_close(a.entropy, b.entropy, atol=0, rtol=0)


def test_offload_matches_no_offload(pg):
    # CPUOffloadPolicy on a CPU mesh runs FSDP's offload path (host copies are no-ops); the CUDA
    # version is in tests/gpu/test_fsdp_gpu.py.
    plain = FSDPEngine(make_model(), CPU, torch.float32, 1.0, ACTOR, offload=False)
    offload = FSDPEngine(make_model(), CPU, torch.float32, 1.0, ACTOR, offload=True)
    # measured 0 (bit-identical on the CPU): exact
    assert_metrics_close(run_steps(offload, steps=2), run_steps(plain, steps=2), atol=0.0)
    # measured 0 (bit-identical on the CPU): exact
    assert_weights_close(dict(offload.export_weights()), dict(plain.export_weights()), atol=0.0)


def _full_grads(engine) -> dict[str, torch.Tensor]:
    return {
        name.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor()
        for name, p in engine.model.named_parameters()
    }


def test_activation_checkpointing_same_gradients(pg):
    grads = {}
    mbs, _ = local_micro_batches(make_batch(8, 2, with_old_ref=True), CAP)
    for mode in ("none", "selective", "full"):
        engine = FSDPEngine(make_model(), CPU, torch.float32, 1.0, ACTOR, activation_checkpointing=mode)
        engine.forward_backward(mbs, LOSSES[1], max_response_len=16)
        grads[mode] = _full_grads(engine)
        assert any("_checkpoint_wrapped_module" in n for n, _ in engine.model.named_parameters()) == (mode != "none")
    for mode in ("selective", "full"):
        # measured 0 (bit-identical on the CPU): exact
        assert_weights_close(grads[mode], grads["none"], atol=0.0)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def test_checkpoint_modes_recompute_what_they_document():
    """selective recomputes elementwise ops (SiLU, RMSNorm) but replays saved matmuls; full recomputes all."""
    counts = {}
    n = 10
    for mode in ("none", "selective", "full"):
        model = parallelize(make_model(), activation_checkpointing=mode)  # mesh=None: no sharding
        with _CountOps() as mode_counter:
            hidden = model(torch.arange(3, 3 + n), torch.arange(n), torch.tensor([0, n], dtype=torch.int32), n)
            hidden.square().sum().backward()
        counts[mode] = mode_counter.counts
    layers = get_preset("tiny").num_layers
    assert counts["none"]["aten.silu.default"] == layers
    assert counts["selective"]["aten.silu.default"] == counts["full"]["aten.silu.default"] == 2 * layers
    assert counts["selective"]["aten.mm.default"] == counts["none"]["aten.mm.default"]
    # full reruns the block's linears (up to the last one needed: non-reentrant checkpoint stops early)
    assert counts["full"]["aten.mm.default"] >= counts["none"]["aten.mm.default"] + 6 * layers


# bf16 master weights (engine/optim.py): the optimizer state, its step counter and the rounding stream resume too
BF16_ACTOR = ActorSection(lr=1e-3, eps=1e-4, grad_clip=1.0, max_tokens_per_mb=CAP, master_dtype="bfloat16")


@pytest.mark.parametrize("dtype, actor", [(torch.float32, ACTOR), (torch.bfloat16, BF16_ACTOR)], ids=["fp32", "bf16-master"])
def test_save_load_resumes_exactly(pg, tmp_path, dtype, actor):
    first = FSDPEngine(make_model(), CPU, dtype, 1.0, actor)
    run_steps(first, steps=1)
    first.save(tmp_path)
    resumed = FSDPEngine(make_model(seed=7), CPU, dtype, 1.0, actor)
    resumed.load(tmp_path)
    # The same next minibatch on the original and on the restored engine: bit-identical.
    mbs, _ = local_micro_batches(BATCHES[1](), CAP)
    want = first.forward_backward(mbs, LOSSES[1], max_response_len=16) | first.optim_step()
    got = resumed.forward_backward(mbs, LOSSES[1], max_response_len=16) | resumed.optim_step()
    assert got == want
    got_w, want_w = dict(resumed.export_weights()), dict(first.export_weights())
    assert sorted(got_w) == sorted(want_w)
    for name in want_w:
        assert got_w[name].dtype == getattr(torch, actor.master_dtype) and torch.equal(got_w[name], want_w[name]), name


def test_build_engine_selects_backend(pg):
    local_actor = ActorSection(backend="local", activation_checkpointing="full")
    fsdp_actor = ActorSection(backend="fsdp")
    assert type(build_engine(make_model(), CPU, torch.float32, 1.0, local_actor)) is LocalEngine
    engine = build_engine(make_model(), CPU, torch.float32, 1.0, fsdp_actor)
    assert isinstance(engine, FSDPEngine) and engine.optimizer is not None
    ref = build_engine(make_model(), CPU, torch.float32, 1.0, fsdp_actor, forward_only=True)
    assert isinstance(ref, FSDPEngine) and ref.optimizer is None
    assert not any(p.requires_grad for p in ref.model.parameters())
    mbs, _ = local_micro_batches(make_batch(8, 1), CAP)
    want = LocalEngine(make_model(), CPU, torch.float32, 1.0).forward_logprobs(mbs)
    for got, exp in zip(ref.forward_logprobs(mbs), want, strict=True):
        # measured 0 (bit-identical on the CPU): exact
        torch.testing.assert_close(got.logprobs, exp.logprobs, atol=0, rtol=0)
    with pytest.raises(ValueError, match="actor config section"):
        build_engine(make_model(), CPU, torch.float32, 1.0, None)


# ---------------------------------------------------------------- two ranks


def _two_rank_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    try:
        engine = FSDPEngine(make_model(), CPU, torch.float32, 1.0, ACTOR)
        # Log-probs of a batch split over ranks, gathered back into batch order on every rank.
        batch = make_batch(8, 1)
        mbs, ids = local_micro_batches(batch, CAP, rank=rank, world=world)
        outs = engine.forward_logprobs(mbs)
        logprobs = gather_per_token([o.logprobs for o in outs], ids, batch)
        metrics = run_steps(engine, rank=rank, world=world)  # the 3rd batch leaves rank 1 an empty micro-batch
        weights = dict(engine.export_weights())
        engine.save(Path(out_dir) / "ckpt")
        torch.save({"metrics": metrics, "weights": weights, "logprobs": logprobs, "num_mbs": len(mbs)},
                   Path(out_dir) / f"rank{rank}.pt")  # fmt: skip
    finally:
        destroy_distributed()


def test_two_ranks_match_one_process(pg, local_ref, tmp_path):
    mp.spawn(_two_rank_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    want_metrics, want_weights, local = local_ref
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [res["num_mbs"] for res in results] == [2, 2]  # the plan really split the batch
    # ... and the one-sequence batch really gives one rank a padding micro-batch
    shares = [local_micro_batches(BATCHES[2](), CAP, rank=r, world=2)[1] for r in range(2)]
    assert sorted(shares) == [[()], [(0,)]]
    for res in results:
        # 2 ranks vs 1 process: measured max |diff| 1.2e-07 (rel 9.9e-08), 4x margin
        assert_metrics_close(res["metrics"], want_metrics, atol=5e-7)
        # measured max |diff| 2.0e-08 on most machines, one fp32 step (1.19e-07) on others: the norm weights
        # sit at ~1.0, where a single rounding of the reduced gradient moves them by an ulp; two ulps there
        assert_weights_close(res["weights"], want_weights, atol=2.4e-7)
    # both ranks hold identical full weights and identical gathered log-probs
    # exact: measured 0 (every rank holds the same full weights)
    assert_weights_close(results[1]["weights"], results[0]["weights"], atol=0.0)
    batch = make_batch(8, 1)
    mbs, ids = local_micro_batches(batch, CAP)
    fresh = LocalEngine(make_model(), CPU, torch.float32, 1.0)
    want_lp = gather_per_token([o.logprobs for o in fresh.forward_logprobs(mbs)], ids, batch)
    for res in results:
        # measured 0 (bit-identical on the CPU): exact
        torch.testing.assert_close(res["logprobs"], want_lp, atol=0, rtol=0)

    # The 2-rank checkpoint restores into one process (DCP reshards it) with its optimizer and
    # scheduler state: one more step matches the local engine's.
    engine = FSDPEngine(make_model(seed=7), CPU, torch.float32, 1.0, ACTOR)
    engine.load(tmp_path / "ckpt")
    # as above: up to one fp32 step at the norm weights' ~1.0
    assert_weights_close(dict(engine.export_weights()), want_weights, atol=2.4e-7)
    mbs, _ = local_micro_batches(BATCHES[0](), CAP)
    got = engine.forward_backward(mbs, LOSSES[0], max_response_len=16) | engine.optim_step()
    want = local.forward_backward(mbs, LOSSES[0], max_response_len=16) | local.optim_step()
    # measured 0 here, although the weights differ by up to 2e-08 (above); 1e-6 = a few fp32 ulps
    assert_metrics_close([got], [want], atol=1e-6)
    # measured max |diff| 6.0e-08: 3x margin
    assert_weights_close(dict(engine.export_weights()), dict(local.export_weights()), atol=2e-7)


def test_warns_when_a_specific_gpu_is_not_the_one_used():
    from slipstream.engine.distributed import warn_if_other_device

    with pytest.warns(UserWarning, match="cuda:1 was requested but this rank uses cuda:0"):
        warn_if_other_device("cuda:1", torch.device("cuda", 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_other_device("cuda", torch.device("cuda", 0))  # no index asked: nothing to say
        warn_if_other_device(torch.device("cuda", 0), torch.device("cuda", 0))
        warn_if_other_device("cpu", torch.device("cpu"))
