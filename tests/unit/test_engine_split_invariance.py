"""Through the real engine: parameter gradients do not depend on how a minibatch is cut into micro-batches."""

import pytest
import torch

from slipstream.algo.losses import LossSpec, SpecLoss
from slipstream.batching.packing import pack_samples, select
from slipstream.batching.records import Sample
from slipstream.config.schema import ActorSection
from slipstream.engine.local import LocalEngine
from slipstream.models.presets import get_preset
from slipstream.models.transformer import Transformer


def Loss(mode: str) -> SpecLoss:  # noqa: N802 -- reads like the class it builds
    """PPO clip + KL + entropy terms, aggregated by `mode`."""
    return SpecLoss(LossSpec(kl_coef=0.1, entropy_coef=0.01, agg_mode=mode, clip_low=0.1, clip_high=0.1))


def _batch(vocab):
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(14):
        p, r = 3 + i % 4, (i * 5) % 11  # includes an empty response (i = 0)
        ids = torch.randint(3, vocab, (p + r,), generator=gen).tolist()
        samples.append(Sample(prompt_ids=tuple(ids[:p]), response_ids=tuple(ids[p:]), behav_logprobs=(0.0,) * r))
    batch = pack_samples(samples, torch.randn(14, generator=gen))
    # old / ref log-probs near the random-init policy's (~ -log V), as in a real step: ratios near 1,
    # some of them clipped at clip 0.1
    T, base = batch.num_tokens, -torch.log(torch.tensor(float(vocab)))
    old = base + 0.2 * torch.randn(T, generator=gen)
    ref = base + 0.2 * torch.randn(T, generator=gen)
    return batch.with_(old_logprobs=old, ref_logprobs=ref)


def _grads(batch, splits, mode):
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"))
    model.init_weights(0)
    engine = LocalEngine(model, torch.device("cpu"), torch.float32, temperature=0.7, actor=ActorSection())
    ids = list(range(batch.num_seqs))
    chunks = [ids[i::splits] for i in range(splits)]
    metrics = engine.forward_backward([select(batch, c) for c in chunks], Loss(mode), max_response_len=10)
    return metrics, {n: p.grad.clone() for n, p in engine.model.named_parameters()}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_gradients_equal_for_1_3_7_micro_batches(mode):
    batch = _batch(get_preset("tiny").vocab_size)
    ref_metrics, ref = _grads(batch, 1, mode)
    for splits in (3, 7):
        metrics, grads = _grads(batch, splits, mode)
        assert metrics["actor/num_micro_batches"] == splits
        for key in ("actor/pg_loss", "actor/kl", "actor/entropy"):
            # measured max |diff| 4.8e-07 (rel 3.5e-07): 2x margin
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-6, abs=1e-6), key
        for name, g in grads.items():
            # measured max |diff| 7.2e-07 (13% of the tolerance): 7x margin
            torch.testing.assert_close(g, ref[name], atol=1e-6, rtol=1e-5, msg=f"{mode} {splits} {name}")
