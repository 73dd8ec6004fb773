"""The verl cell of `slipstream bench matrix`: rollout layout, explained rows, spec options, stand-ins.

The tests that run verl itself need a verl site directory (`bash benchmarks/gpu_setup.sh verl-local DIR`)
named by SLIPSTREAM_VERL_SITE, and skip without it (CI has none).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from slipstream.bench import train_step as ts
from slipstream.bench.settings import CellSettings, VerlSettings
from slipstream.bench.spec import parse_spec
from slipstream.bench.naive import paired_models
from benchmarks.peers import verl_adapter
from benchmarks.peers.standin import write_standin_site
from benchmarks.peers.verl_runner import verl_rollout_tensors
from slipstream.bench.workloads import get_workload, make_lengths


def _packed_logprobs(native, batch) -> torch.Tensor:
    """slipstream's per-token log-probs of the packed batch at its loss positions, in sequence order."""
    engine = ts.build_engine_for_bench(native, "local", torch.device("cpu"), torch.float32)
    (out,) = engine.forward_logprobs([batch])
    return out.logprobs[batch.loss_mask]


def test_rollout_layout_is_verls_padding_and_gives_slipstreams_logprobs():
    cfg, native, hf_model, batch = paired_models(get_workload("tiny"), seed=0)
    t = verl_rollout_tensors(batch, pad_token_id=0)
    num_seqs, width = t["input_ids"].shape
    prompt_width = t["prompts"].shape[1]
    prompt_mask, response_mask = t["attention_mask"][:, :prompt_width], t["response_mask"]
    cu = batch.cu_seqlens.tolist()
    for i in range(num_seqs):
        p, r = int(prompt_mask[i].sum()), int(response_mask[i].sum())
        assert p + r == cu[i + 1] - cu[i]
        # Prompts end at the prompt / response border (left padding); responses start there (right padding).
        assert prompt_mask[i, prompt_width - p :].all() and not prompt_mask[i, : prompt_width - p].any()
        assert response_mask[i, :r].all() and not response_mask[i, r:].any()
        real = t["attention_mask"][i].bool()
        assert torch.equal(t["input_ids"][i, real], batch.input_ids[cu[i] : cu[i + 1]])
        assert torch.equal(t["position_ids"][i, real], torch.arange(p + r))
        # Old log-probs / advantages of response token j come from the packed position predicting it.
        loss = batch.loss_mask[cu[i] : cu[i + 1]]
        assert torch.equal(t["old_log_probs"][i, :r], batch.old_logprobs[cu[i] : cu[i + 1]][loss])
        assert torch.equal(t["advantages"][i, :r], batch.advantages[cu[i] : cu[i + 1]][loss])
    assert width == prompt_width + t["responses"].shape[1]

    # A log-prob read through the padded layout (logits at column c predict the token at c + 1)
    # equals slipstream's packed log-prob of the same weights.
    with torch.no_grad():
        logits = hf_model(
            input_ids=t["input_ids"], attention_mask=t["attention_mask"], position_ids=t["position_ids"],
            use_cache=False,
        ).logits.double()  # fmt: skip
    logp = torch.log_softmax(logits[:, prompt_width - 1 : -1], dim=-1)
    logp = logp.gather(-1, t["responses"].unsqueeze(-1)).squeeze(-1)
    padded = logp[response_mask.bool()]
    # fp32, HF padded vs slipstream packed: measured 5.5e-07, 3.6x margin
    torch.testing.assert_close(padded, _packed_logprobs(native, batch).double(), atol=2e-6, rtol=0)


def test_no_site_gives_a_missing_row_that_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.delenv(verl_adapter.SITE_ENV, raising=False)
    row = verl_adapter.run_verl_cell(get_workload("tiny"), CellSettings(), VerlSettings(), "fsdp")
    assert row["status"] == "missing" and verl_adapter.SITE_ENV in row["reason"]
    assert "gpu_setup.sh" in row["install"] and row["impl"]["standins"] == list(verl_adapter.STANDINS)
    monkeypatch.setenv(verl_adapter.SITE_ENV, str(tmp_path))  # a directory without verl in it
    row = verl_adapter.run_verl_cell(get_workload("tiny"), CellSettings(), VerlSettings(), "fsdp")
    assert row["status"] == "missing" and "has no verl package" in row["reason"]


def test_megatron_row_is_explained():
    row = verl_adapter.run_verl_cell(get_workload("tiny"), CellSettings(), VerlSettings(), "megatron")
    assert row["status"] == "not-available" and row["impl"]["config"]["engine"] == "megatron"
    assert "Transformer Engine" in row["reason"] and "use_mbridge" in row["reason"]


def _spec(**verl) -> dict:
    return {"workloads": ["tiny"], "frameworks": ["verl"], "backends": ["fsdp"], "peers": {"verl": verl}}


def test_spec_verl_options(tmp_path):
    site = tmp_path / "site"
    (site / "verl").mkdir(parents=True)
    (site / "verl" / "__init__.py").write_text("")
    options = dict(strategy="fsdp2", use_dynamic_bsz=False, micro_batch_size_per_gpu=4, site_dir=str(site))
    assert parse_spec(_spec(**options)).verl == VerlSettings(**options)
    assert parse_spec(_spec()).verl == VerlSettings()
    with pytest.raises(ValueError, match="not a verl site directory"):
        parse_spec(_spec(site_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="did you mean 'fsdp2'"):
        parse_spec(_spec(strategy="fsdp_2"))
    longest = max(p + r for p, r in make_lengths(get_workload("tiny")))
    with pytest.raises(ValueError, match="below the longest sequence"):
        parse_spec(_spec(max_token_len_per_gpu=longest - 1))
    with pytest.raises(ValueError, match="does not divide the 8 sequences"):
        parse_spec(_spec(use_dynamic_bsz=False, micro_batch_size_per_gpu=3))
    with pytest.raises(ValueError, match="did you mean 'site_dir'"):
        parse_spec(_spec(sitedir=str(site)))
    best = dict(attn_implementation="torch_varlen", use_remove_padding=True, use_fused_kernels=True,
                fused_kernels_backend="triton")  # fmt: skip
    assert parse_spec(_spec(**best)).verl == VerlSettings(**best)
    with pytest.raises(ValueError, match="torch_varlen needs use_remove_padding"):
        parse_spec(_spec(attn_implementation="torch_varlen"))


def test_standins_import_but_refuse_to_run(tmp_path):
    # In a subprocess: the stand-ins shadow real packages (pydantic) for the whole interpreter.
    code = """
import ray, uvicorn, pydantic
from ray.util.placement_group import placement_group
from benchmarks.peers.standin import StandInUsed

@ray.remote
class Actor: ...

class Server(uvicorn.Server): ...

class Schema(pydantic.BaseModel):
    x: int = 0

for call in (lambda: ray.get(1), lambda: Actor.remote(), lambda: placement_group([]), Server, Schema):
    try:
        call()
    except StandInUsed:
        continue
    raise SystemExit("a stand-in ran")
print("ok", ray.IS_SLIPSTREAM_STANDIN)
"""
    site = write_standin_site(tmp_path / "standins")
    packages = sorted(p.name for p in site.iterdir() if (p / "__init__.py").is_file())
    assert packages == sorted(verl_adapter.STANDINS)  # the row lists exactly the stand-ins written
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(verl_adapter.SLIPSTREAM_ROOT), str(verl_adapter.BENCHMARKS_ROOT)])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok True"


def _site_or_skip():
    site, why = verl_adapter.resolve_site(VerlSettings())
    if site is None:
        pytest.skip(why)
    return site


_CPU = CellSettings(dtype="float32", recompute="full", repeats=1, warmup=0, device="cpu", max_tokens_per_mb=128)
_VERL = VerlSettings(strategy="fsdp2", use_torch_compile=False)


def test_verl_runs_its_own_actor_on_cpu():
    _site_or_skip()
    w = get_workload("tiny")
    row = verl_adapter.run_verl_cell(w, _CPU, _VERL, "fsdp")
    assert row["status"] == "ok", row.get("reason")
    versions = row["impl"]["versions"]
    assert versions["verl"] == "0.9.1" and versions["transformers"].startswith("5.10.")  # the site's, not ours
    mb, fair = row["micro_batches"], row["fairness"]
    assert sum(mb["num_seqs"]) == w.num_seqs and mb["count"] >= 2  # 264 real tokens, budget 128
    assert sum(mb["real_tokens"]) == fair["real_tokens"] < fair["padded_tokens"] == sum(mb["padded_tokens"])
    assert row["impl"]["config"]["resolved"]["actor"]["loss_agg_mode"] == "token-mean"
    assert row["phases"]["actor_train"]["time_s"] > 0 and row["phases"]["log_probs"]["time_s"] > 0


# verl's remove-padding path as its users run it: varlen attention (here torch's, peers/verl_varlen.py)
# over one packed row per micro-batch, and its fused log-prob kernels (the torch backend on the CPU).
_VERL_VARLEN = VerlSettings(
    strategy="fsdp2", use_torch_compile=False, attn_implementation="torch_varlen", use_remove_padding=True,
    use_fused_kernels=True,
)  # fmt: skip


def test_verl_remove_padding_row_says_what_ran():
    _site_or_skip()
    row = verl_adapter.run_verl_cell(get_workload("tiny"), _CPU, _VERL_VARLEN, "fsdp")
    assert row["status"] == "ok", row.get("reason")
    fair = row["fairness"]
    assert fair["padded_tokens"] == fair["real_tokens"] and fair["padding_fraction"] == 0.0
    assert "torch varlen_attn" in fair["attention_kernel"] and "fused kernels (torch backend)" in fair["logprob_head"]
    resolved = row["impl"]["config"]["resolved"]["model"]
    assert resolved["attn_implementation"] == "torch_varlen" and resolved["use_fused_kernels"]


@pytest.mark.parametrize("verl", [_VERL, _VERL_VARLEN], ids=["padded-sdpa", "remove-padding-varlen-fused"])
def test_verl_log_probs_equal_slipstreams(tmp_path, verl):
    site = _site_or_skip()
    w = get_workload("tiny")
    cfg, native, hf_model, batch = paired_models(w, seed=0)
    hf_model.save_pretrained(tmp_path / "model")
    request = verl_adapter.runner_request(w, _CPU, verl)
    request.update(model_dir=str(tmp_path / "model"), return_log_probs=True)
    result = verl_adapter.run_runner(request, site)
    verl_logp = torch.tensor(result["log_probs"])[torch.tensor(result["response_mask"]).bool()]
    # fp32, verl's engine vs slipstream: measured 9.5e-07, 3x margin
    torch.testing.assert_close(verl_logp, _packed_logprobs(native, batch), atol=3e-6, rtol=0)
