"""The async loop on one GPU: the producer thread generates on its own CUDA stream while the trainer
trains on the default stream. A missing ordering between the two (the rollout reading weights while the
trainer copies them in, an eval meeting the rollout's queued work) shows as behaviour log-probs that
disagree with the trainer's recomputation of the same tokens under the same weights."""

from __future__ import annotations

import pytest
import torch

from slipstream.config import load_config
from slipstream.controller.trainer import RLTrainer
from slipstream.controller.producer import RolloutProducer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_async_on_its_own_stream_keeps_behaviour_logprobs_exact(tmp_path, monkeypatch):
    # the demo recipe (tiny model, fp32) with a large learning rate, so every weight sync changes the policy
    # a lot: tokens sampled by a half-copied policy would be far from the trainer's log-probs. max_staleness 0:
    # the producer starts batch j right after weight sync j (the window a missing wait would open), and every
    # token is then sampled by the weights the trainer scores it with
    cfg = load_config("recipes/demo.yaml", [
        f"trainer.run_dir={tmp_path}", "trainer.device=cuda", "trainer.mode=async", "trainer.max_staleness=0",
        "trainer.total_steps=8", "eval.every_steps=3", "actor.lr=3e-3", "rollout.max_new_tokens=4",
        "logging.tensorboard=false", "trainer.export_hf=false", "reward.num_workers=0",
    ])  # fmt: skip
    streams = []
    start = RolloutProducer.start
    monkeypatch.setattr(RolloutProducer, "start", lambda self: (streams.append(self.stream), start(self))[1])
    trainer = RLTrainer(cfg)
    rows, evals = [], []
    log = trainer.logger.log

    def keep(step, metrics):
        (rows if "reward/mean" in metrics else evals).append(metrics)
        log(step, metrics)

    trainer.logger.log = keep
    trainer.fit()
    assert streams and all(isinstance(s, torch.cuda.Stream) for s in streams)
    assert len(rows) == 8
    # evals (the rollout engine changing hands): before training, after steps 3 and 6, at the end
    assert sum("eval/sum/accuracy" in m for m in rows + evals) == 4
    diffs = [r["rollout/logprob_abs_diff_mean"] for r in rows]
    # fp32 tiny model: rollout and trainer agree to ~1e-6; a race would give differences of order 0.1-1
    assert max(diffs) < 1e-4, diffs
    assert max(r["async/staleness_max"] for r in rows) == 0
