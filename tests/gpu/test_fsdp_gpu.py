"""CUDA tests of the FSDP2 backend: bf16 mixed precision, CPU offload, compile, two GPUs over NCCL."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from measured import report
from slipstream.algo.losses import LossSpec, SpecLoss
from slipstream.batching.packing import pack_samples
from slipstream.batching.records import PackedBatch, Sample
from slipstream.config.schema import ActorSection
from slipstream.engine.distributed import destroy_distributed, free_port, init_distributed
from slipstream.batching.shard import local_micro_batches
from slipstream.engine.factory import build_engine
from slipstream.engine.fsdp import FSDPEngine
from slipstream.engine.local import LocalEngine
from slipstream.models import hf
from slipstream.models.presets import get_preset
from slipstream.models.transformer import Transformer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CUDA = torch.device("cuda")
CAP = 64
ACTOR = ActorSection(lr=1e-3, eps=1e-4, grad_clip=1.0, max_tokens_per_mb=CAP)
BF16 = torch.bfloat16


Loss = SpecLoss  # the engines' LossFn over a LossSpec (needs_entropy=True)


LOSSES = (Loss(LossSpec(entropy_coef=0.01)), Loss(LossSpec(agg_mode="seq-mean-token-mean", kl_coef=0.1)))


def make_batch(num_seqs: int, seed: int) -> PackedBatch:
    gen = torch.Generator().manual_seed(seed)
    vocab = get_preset("tiny").vocab_size
    samples = []
    for i in range(num_seqs):
        p, r = int(torch.randint(2, 12, (1,), generator=gen)), int(torch.randint(4, 40, (1,), generator=gen))
        samples.append(Sample(
            prompt_ids=tuple(torch.randint(3, vocab, (p,), generator=gen).tolist()),
            response_ids=tuple(torch.randint(3, vocab, (r,), generator=gen).tolist()),
            behav_logprobs=(-4.5,) * r,
            group_id=i // 2,
        ))  # fmt: skip
    batch = pack_samples(samples, torch.randn(num_seqs, generator=gen))
    return batch.with_(ref_logprobs=-4.5 + 0.2 * torch.randn(batch.num_tokens, generator=gen))


def make_model(seed: int = 0) -> Transformer:
    model = Transformer(get_preset("tiny"))
    model.init_weights(seed)
    return model


def step(engine, seed: int, loss: Loss, rank: int = 0, world: int = 1) -> dict[str, float]:
    mbs, _ = local_micro_batches(make_batch(12, seed), CAP, rank=rank, world=world)
    metrics = engine.forward_backward(mbs, loss, max_response_len=48)
    return metrics | engine.optim_step()


def full_grads(engine) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in engine.model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out[name.replace("_checkpoint_wrapped_module.", "")] = grad.float().cuda()
    return out


def local_device(engine) -> set[str]:
    return {(p.to_local() if isinstance(p, DTensor) else p).device.type for p in engine.model.parameters()}


@pytest.fixture(scope="module")
def pg():
    init_distributed("cuda")
    yield
    destroy_distributed()


def test_bf16_step_matches_local(pg):
    local = LocalEngine(make_model(), CUDA, BF16, 1.0, ACTOR)
    fsdp = FSDPEngine(make_model(), CUDA, BF16, 1.0, ACTOR)
    mbs, _ = local_micro_batches(make_batch(12, 1), CAP)
    want = local.forward_backward(mbs, LOSSES[1], max_response_len=48)
    got = fsdp.forward_backward(mbs, LOSSES[1], max_response_len=48)
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl"):
        report(f"fsdp vs local bf16 {key}", got[key], want[key])
        # bf16, two engines; not measured on the GPU yet: report() prints it
        assert got[key] == pytest.approx(want[key], rel=2e-2, abs=2e-3), key
    g_local, g_fsdp = full_grads(local), full_grads(fsdp)
    for name, g in g_local.items():
        cos = torch.nn.functional.cosine_similarity(g.flatten(), g_fsdp[name].flatten(), dim=0)
        assert cos > 0.98, (name, float(cos))
    want_norm, got_norm = local.optim_step()["actor/grad_norm"], fsdp.optim_step()["actor/grad_norm"]
    report("fsdp vs local bf16 grad_norm", got_norm, want_norm)
    # not measured on the GPU yet: report() prints it
    assert got_norm == pytest.approx(want_norm, rel=3e-2)
    # master weights and optimizer state stay fp32
    assert {p.dtype for p in fsdp.model.parameters()} == {torch.float32}
    assert all(v.dtype == torch.float32 for _, v in fsdp.export_weights())


def test_offload_matches_no_offload(pg):
    """Offload on and off are equally close to an fp32 run of the same steps.

    Measured on the H200 (docs/results/2026-12-02-h200-diag-offload.txt): two runs without offload are bit-identical,
    while offload changes the bf16 gradients by up to ~2e-3 of their scale before the first
    optimizer step (the offloaded path rounds at other points), and AdamW carries that into the
    weights. So "matches" is judged against the fp32 result: a real offload bug (a dropped
    micro-batch, a wrong scale) lands far from it, a different bf16 rounding does not.
    """
    plain = FSDPEngine(make_model(), CUDA, BF16, 1.0, ACTOR, offload=False)
    offload = FSDPEngine(make_model(), CUDA, BF16, 1.0, ACTOR, offload=True)
    exact = FSDPEngine(make_model(), CUDA, torch.float32, 1.0, ACTOR, offload=False)
    assert local_device(plain) == {"cuda"} and local_device(offload) == {"cpu"}
    for seed, loss in ((1, LOSSES[0]), (2, LOSSES[1])):
        want, got, ref = step(plain, seed, loss), step(offload, seed, loss), step(exact, seed, loss)
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            report(f"offload vs plain {key}", got[key], want[key])
            # not measured on the GPU yet: report() prints it; the line below bounds it by the plain run's distance to fp32
            assert got[key] == pytest.approx(want[key], rel=1e-2, abs=1e-4), key
            assert abs(got[key] - ref[key]) <= 2 * abs(want[key] - ref[key]) + 1e-4, key
    assert local_device(offload) == {"cpu"}
    want_w, got_w, ref_w = (dict(e.export_weights()) for e in (plain, offload, exact))
    dist_plain = sum(float((want_w[n] - ref_w[n]).square().sum()) for n in ref_w) ** 0.5
    dist_offload = sum(float((got_w[n].cuda() - ref_w[n]).square().sum()) for n in ref_w) ** 0.5
    init = hf.to_hf_state_dict(make_model().state_dict())
    update = sum(float((ref_w[n] - init[n].to(CUDA)).square().sum()) for n in ref_w) ** 0.5
    print(f"\n| |W_bf16 - W_fp32|: no offload {dist_plain:.3e}, offload {dist_offload:.3e}; |update| {update:.3e} |")
    assert dist_offload <= 1.5 * dist_plain + 1e-6
    assert dist_offload < 0.1 * update  # both bf16 runs made (nearly) the fp32 run's update


def _assert_steps_close(got: dict, want: dict) -> None:
    # Flash-attention backward accumulates with atomics, so two identical runs agree only closely.
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        report(f"same steps twice {key}", got[key], want[key])
        # flash-attention's atomics only; not measured on the GPU yet: report() prints it
        assert got[key] == pytest.approx(want[key], rel=1e-3, abs=1e-5), key


def test_offload_onload_round_trip(pg):
    moved = FSDPEngine(make_model(), CUDA, BF16, 1.0, ACTOR)
    stay = FSDPEngine(make_model(), CUDA, BF16, 1.0, ACTOR)
    _assert_steps_close(step(moved, 1, LOSSES[0]), step(stay, 1, LOSSES[0]))
    moved.offload()
    assert local_device(moved) == {"cpu"}
    assert all(v.device.type == "cpu" for s in moved.optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)  # fmt: skip
    moved.onload()
    assert local_device(moved) == {"cuda"}
    _assert_steps_close(step(moved, 2, LOSSES[1]), step(stay, 2, LOSSES[1]))
    got, want = dict(moved.export_weights()), dict(stay.export_weights())
    for name in want:
        report(f"offload round trip {name}", got[name], want[name])
        # not measured on the GPU yet: report() prints it
        torch.testing.assert_close(got[name], want[name], atol=5e-5, rtol=0, msg=name)


def test_forward_only_reference_offload(pg):
    fsdp_actor = ActorSection(backend="fsdp", offload_ref=True)
    on_gpu = build_engine(make_model(), CUDA, BF16, 1.0, fsdp_actor, forward_only=True, offload=False)
    on_cpu = build_engine(make_model(), CUDA, BF16, 1.0, fsdp_actor, forward_only=True)  # offload_ref
    assert local_device(on_gpu) == {"cuda"} and local_device(on_cpu) == {"cpu"}
    mbs, _ = local_micro_batches(make_batch(12, 3), CAP)
    for a, b in zip(on_gpu.forward_logprobs(mbs), on_cpu.forward_logprobs(mbs)):
        report("reference on GPU vs offloaded", a.logprobs, b.logprobs)
        # not measured on the GPU yet: report() prints it
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("compile_, ac", [(True, "none"), (True, "selective"), (False, "full")])
def test_compile_and_checkpointing_match_eager(pg, compile_, ac):
    eager = FSDPEngine(make_model(), CUDA, BF16, 1.0, ACTOR)
    other = FSDPEngine(make_model(), CUDA, BF16, 1.0, ACTOR, compile=compile_, activation_checkpointing=ac)
    want, got = step(eager, 1, LOSSES[1]), step(other, 1, LOSSES[1])
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        report(f"compile={compile_} ac={ac} {key}", got[key], want[key])
        # bf16, other kernels; not measured on the GPU yet: report() prints it
        assert got[key] == pytest.approx(want[key], rel=2e-2, abs=1e-3), key


# ---------------------------------------------------------------- two GPUs


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    try:
        engine = FSDPEngine(make_model(), CUDA, torch.float32, 1.0, ACTOR)
        metrics = [step(engine, 1, LOSSES[0], rank, 2), step(engine, 2, LOSSES[1], rank, 2)]
        weights = {k: v.cpu() for k, v in engine.export_weights()}
        torch.save({"metrics": metrics, "weights": weights}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        destroy_distributed()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_match_one_gpu_fp32(tmp_path):
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    local = LocalEngine(make_model(), CUDA, torch.float32, 1.0, ACTOR)
    want = [step(local, 1, LOSSES[0]), step(local, 2, LOSSES[1])]
    want_w = {k: v.cpu() for k, v in local.export_weights()}
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        for g, w in zip(res["metrics"], want):
            for key in ("actor/pg_loss", "actor/entropy", "actor/num_loss_tokens", "actor/grad_norm"):
                report(f"2 GPUs vs 1 {key}", g[key], w[key])
                # fp32; not measured on the GPU yet: report() prints it
                assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-5), key
        for name in want_w:
            report(f"2 GPUs vs 1 {name}", res["weights"][name], want_w[name])
            # fp32; not measured on the GPU yet: report() prints it
            torch.testing.assert_close(res["weights"][name], want_w[name], atol=1e-4, rtol=0, msg=name)
