"""Builtin rollout engine on the CPU (fp32): continuous batching must not change what is sampled.

References: a token-by-token full forward of the training model (greedy argmax, behaviour
log-probs), a request generated alone (same key -> same tokens in any crowd, slot count, ring
length or prefill chunking), and a sort-based nucleus filter.
"""

from __future__ import annotations

import pytest
import torch

from slipstream.models.hf import iter_hf_weights
from slipstream.models.presets import get_preset
from slipstream.models.transformer import Transformer
from slipstream.rollout.base import RolloutEngine, SamplingParams
from slipstream.rollout.builtin import BuiltinRollout
from slipstream.rollout.core import decode_buckets, pack_prefill
from slipstream.rollout.kv_cache import SlotCache, kv_bytes_per_token, plan_slots
from slipstream.rollout.sampler import (
    _mix32_int,
    as_int32,
    filter_logits,
    gumbel_noise,
    mix32,
    sample_tokens,
    top_p_threshold,
    vocab_hashes,
)

torch.set_num_threads(1)

CFG = get_preset("tiny")
PROMPTS = [[1, 17, 23, 5, 9], [1, 40], [1, 8, 8, 30], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7]]


def _weights(seed: int = 123, scale: float = 10.0) -> Transformer:
    # Larger weights than the 0.02 init make the next-token distribution peaked, so greedy
    # decoding is not decided by float noise between near-equal logits.
    ref = Transformer(CFG)
    ref.init_weights(seed)
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    return ref


def _engine(seed: int = 0, **kw) -> BuiltinRollout:
    engine = BuiltinRollout(CFG, max_batch_size=kw.pop("max_batch_size", 8), seed=seed, **kw)
    engine.update_weights(iter_hf_weights(_weights()), version=3)
    return engine


def _full_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    """Logits (len, V) of one sequence from the packed (training) forward."""
    x = torch.tensor(ids)
    cu = torch.tensor([0, len(ids)], dtype=torch.int32)
    with torch.no_grad():
        return model.logits(model(x, torch.arange(len(ids)), cu, len(ids)))


def _ids(out):
    return [[s.response_ids for s in group] for group in out]


def test_builtin_satisfies_protocol():
    assert isinstance(_engine(), RolloutEngine)


@pytest.mark.parametrize("slots,ring", [(8, 16), (3, 2), (1, 1)])
def test_greedy_equals_argmax_decoding_with_mixed_budgets(slots, ring):
    # 3 slots for 10 samples: finished samples hand their slot to waiting ones mid-generation
    engine = _engine(max_batch_size=slots, decode_steps_per_sync=ring)
    budgets = [[6, 2], [1, 5], [4, 4], [3, 7], [2, 6]]
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=7, n=2), budgets=budgets)
    for prompt, group, budget in zip(PROMPTS, out, budgets):
        for sample, b in zip(group, budget):
            seq = list(prompt)
            for _ in range(b):  # reference: recompute the whole sequence, take the argmax
                seq.append(int(_full_logits(engine.model, seq)[-1].argmax()))
            assert list(sample.response_ids) == seq[len(prompt) :]
            assert sample.finish_reason == "length" and sample.version == 3
            assert sample.token_versions == (3,) * b and sample.prompt_ids == tuple(prompt)


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 20)])
def test_behaviour_logprobs_match_recomputed_forward(temperature, top_p, top_k):
    engine = _engine(max_batch_size=4)  # 10 rows through 4 slots
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=8, n=2)
    out = engine.generate(PROMPTS, sampling)
    assert [len(group) for group in out] == [2] * len(PROMPTS)
    for gid, group in enumerate(out):
        for sample in group:
            assert sample.group_id == gid and len(sample.response_ids) == 8
            seq = list(sample.prompt_ids) + list(sample.response_ids)
            logits = _full_logits(engine.model, seq)[len(sample.prompt_ids) - 1 : -1]
            # Same convention as the trainer: log_softmax(logits / T), no top-k/top-p renormalisation.
            ref = (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(sample.response_ids)[:, None])
            # measured max |diff| 2e-6 (fp32, different summation order); 5x margin
            torch.testing.assert_close(torch.tensor(sample.behav_logprobs), ref.squeeze(-1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("crowd", [1, 7, 64])
def test_a_request_samples_the_same_alone_or_in_a_crowd(crowd):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=9, n=3)
    target, key = [1, 17, 23, 5, 9], 1234
    alone = _engine(max_batch_size=4).generate([target], sampling, keys=[key])[0]
    gen = torch.Generator().manual_seed(crowd)
    others = [torch.randint(1, CFG.vocab_size, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
              for _ in range(crowd)]  # fmt: skip
    where = crowd // 2
    prompts = others[:where] + [target] + others[where:]
    keys = list(range(crowd)) + [key]
    keys = keys[:where] + [key] + keys[where:crowd]
    # another slot count, ring length and prefill chunking: the schedule changes, the samples do not
    engine = _engine(max_batch_size=5, decode_steps_per_sync=3, prefill_tokens=4)
    in_crowd = engine.generate(prompts, sampling, keys=keys)[where]
    assert [s.response_ids for s in in_crowd] == [s.response_ids for s in alone]
    for a, b in zip(alone, in_crowd):
        # measured max |diff| 0 to 1e-6 (batch-dependent GEMM blocking); 10x margin
        torch.testing.assert_close(torch.tensor(a.behav_logprobs), torch.tensor(b.behav_logprobs), atol=1e-5, rtol=0)


def test_keys_and_seed_decide_the_samples():
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, n=3)
    a = _engine(seed=4).generate(PROMPTS, sampling, keys=[10, 11, 12, 13, 14])
    assert _ids(a) == _ids(_engine(seed=4).generate(PROMPTS, sampling, keys=[10, 11, 12, 13, 14]))
    assert _ids(a) != _ids(_engine(seed=5).generate(PROMPTS, sampling, keys=[10, 11, 12, 13, 14]))
    assert _ids(a)[1:] != _ids(_engine(seed=4).generate(PROMPTS, sampling, keys=[20, 21, 22, 23, 24]))[1:]
    # the samples of one group differ from each other (each has its own stream)
    assert len(set(_ids(a)[3])) == 3
    # without keys, consecutive calls continue the numbering (and state_dict carries it)
    engine = _engine(seed=4)
    engine.generate(PROMPTS[:2], sampling)
    state = engine.state_dict()
    later = engine.generate(PROMPTS, sampling)
    resumed = _engine(seed=4)
    resumed.load_state_dict(state)
    assert _ids(resumed.generate(PROMPTS, sampling)) == _ids(later)
    assert _ids(later) == _ids(_engine(seed=4).generate(PROMPTS, sampling, keys=[2, 3, 4, 5, 6]))


def test_stop_tokens_end_samples_and_set_finish_reason():
    engine = _engine(max_batch_size=3, decode_steps_per_sync=4)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    full = [g[0].response_ids for g in engine.generate(PROMPTS, greedy)]
    # a stop token that prompt 0 first produces at step j > 0 (unseen before j)
    j = next(i for i in range(1, 10) if full[0][i] not in full[0][:i])
    stop = full[0][j]
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=[stop]))
    for before, (sample,) in zip(full, out):
        if stop in before:
            end = before.index(stop) + 1
            assert sample.response_ids == before[:end] and sample.finish_reason == "stop"
            assert len(sample.behav_logprobs) == end == len(sample.token_versions)
        else:
            assert sample.response_ids == before and sample.finish_reason == "length"
    assert out[0][0].response_ids == full[0][: j + 1]
    # a stop token sampled as the very first token ends the sample at once
    first = full[1][0]
    one = engine.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=[first]))
    assert one[0][0].response_ids == (first,) and one[0][0].finish_reason == "stop"


def test_groups_larger_than_the_cache_and_chunked_prefill():
    sampling = SamplingParams(temperature=1.0, max_new_tokens=5, n=5)
    reference = _engine(max_batch_size=16).generate(PROMPTS, sampling, keys=[0, 1, 2, 3, 4])
    # 2 slots for groups of 5: each group is admitted in parts; prompts prefilled 3 tokens at a time
    small = _engine(max_batch_size=2, prefill_tokens=3).generate(PROMPTS, sampling, keys=[0, 1, 2, 3, 4])
    assert _ids(small) == _ids(reference)


def test_update_weights_copies_in_place_and_validates():
    engine = BuiltinRollout(CFG, seed=0)
    storage = {name: p.data_ptr() for name, p in engine.model.state_dict().items()}
    src = _weights(99, scale=1.0)
    engine.update_weights(iter_hf_weights(src), version=7)
    assert engine.version == 7
    for (name, a), b in zip(src.state_dict().items(), engine.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert {name: p.data_ptr() for name, p in engine.model.state_dict().items()} == storage
    partial = [(n, t) for n, t in iter_hf_weights(src) if "layers.1." not in n]
    with pytest.raises(ValueError, match="unset"):
        engine.update_weights(partial, version=8)
    with pytest.raises(ValueError, match="unknown weight"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))], version=8)
    # The tied head an HF exporter may send is accepted and ignored.
    engine.update_weights([*iter_hf_weights(src), ("lm_head.weight", src.embed_tokens.weight)], 9)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    before = engine.generate([[1, 2]], greedy)[0][0]
    assert before.version == 9
    # new weights take effect at the next call
    engine.update_weights(iter_hf_weights(_weights()), version=10)
    after = engine.generate([[1, 2]], greedy)[0][0]
    assert after.version == 10 and after.response_ids != before.response_ids


def test_sleep_frees_the_weights_and_the_next_update_brings_them_back():
    engine, awake = _engine(), _engine()
    sampling = SamplingParams(temperature=1.0, n=3, max_new_tokens=6)
    engine.generate(PROMPTS, sampling, keys=list(range(len(PROMPTS))))
    engine.sleep()
    assert all(p.numel() == 0 for p in engine.model.parameters())  # nothing kept, on the device or off it
    assert engine.cache is None and engine.runner.fused == []
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, sampling)
    partial = [(n, t) for n, t in iter_hf_weights(_weights()) if "layers.1." not in n]
    with pytest.raises(ValueError, match="unset"):
        engine.update_weights(partial, version=4)
    with pytest.raises(RuntimeError, match="asleep"):  # woken, but some weights were never written
        engine.generate(PROMPTS, sampling)
    engine.update_weights(iter_hf_weights(_weights()), version=4)
    awake.update_weights(iter_hf_weights(_weights()), version=4)
    keys = list(range(10, 10 + len(PROMPTS)))
    slept, kept = engine.generate(PROMPTS, sampling, keys=keys), awake.generate(PROMPTS, sampling, keys=keys)
    assert _ids(slept) == _ids(kept)
    assert [s.behav_logprobs for g in slept for s in g] == [s.behav_logprobs for g in kept for s in g]
    # the q/k/v weights are views into one fused storage again, so in-place updates reach the decode matmul
    fused_qkv = engine.runner.fused[0][0]
    assert engine.model.layers[0].self_attn.q_proj.weight.untyped_storage().data_ptr() == fused_qkv.untyped_storage().data_ptr()


@pytest.mark.parametrize("overlap", [False, True])
def test_weights_changed_between_steps_tag_tokens_with_versions(overlap):
    engine = _engine(max_batch_size=4, decode_steps_per_sync=2, overlap_decode=overlap)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8)
    core = engine._core_for(16, 1)
    core.configure(sampling, engine.version)
    from slipstream.rollout.core import Request

    core.add([Request((1, 17, 23), (8,), key=0)])
    core.step()  # prefill: token 0
    core.step()  # decode: tokens 1, 2 (overlapped: tokens 3, 4 are queued before they are read)
    engine.update_weights(iter_hf_weights(_weights(7)), version=4)
    finished = []
    while core.has_work:
        finished += core.step()
    (seq,) = finished
    old_tokens = 5 if overlap else 3  # a ring queued before the update runs with the old weights
    assert seq.versions == [3] * old_tokens + [4] * (8 - old_tokens)
    # the first tokens are the old weights' greedy ones; the new weights change what follows (the
    # prefix keeps its cached keys / values from the old weights, so the continuation is not a fresh
    # forward of the new model)
    old = _engine().generate([[1, 17, 23]], sampling)[0][0].response_ids
    assert tuple(seq.tokens[:old_tokens]) == old[:old_tokens] and tuple(seq.tokens[old_tokens:]) != old[old_tokens:]


def test_filter_logits_hand_computed():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = lambda x: torch.isfinite(x)[0].tolist()  # noqa: E731
    assert kept(filter_logits(logits, top_k=2, top_p=1.0)) == [True, True, False, False]
    # top_p=0.8: 0.5 + 0.3 reaches 0.8, so the third token is dropped.
    assert kept(filter_logits(logits, top_k=0, top_p=0.8)) == [True, True, False, False]
    assert kept(filter_logits(logits, top_k=0, top_p=0.81)) == [True, True, True, False]
    assert kept(filter_logits(logits, top_k=0, top_p=0.1)) == [True, False, False, False]
    # Order in the vocabulary must not matter.
    shuffled = logits[:, [2, 0, 3, 1]]
    assert kept(filter_logits(shuffled, top_k=0, top_p=0.8)) == [False, True, False, True]
    # Ties at the cut are all kept: the mass reaches 0.6 at a 0.3 token, so both 0.3 tokens stay.
    tied = torch.tensor([[0.4, 0.3, 0.3]]).log()
    assert kept(filter_logits(tied, top_k=0, top_p=0.6)) == [True, True, True]
    assert kept(filter_logits(tied, top_k=1, top_p=1.0)) == [True, False, False]


def test_top_p_threshold_equals_the_sorted_rule():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        probs = (torch.randn(6, 300, generator=gen) * 3).softmax(-1)
        top_p = float(torch.rand(1, generator=gen)) * 0.98 + 0.01
        ordered = probs.sort(dim=-1, descending=True).values
        reach = (ordered.cumsum(-1) >= top_p).float().argmax(-1, keepdim=True)  # first index reaching top_p
        expected = ordered.gather(-1, reach)
        got = top_p_threshold(probs, torch.tensor(top_p))
        # the cumsum and the masked sum add in different orders: a cut exactly at a rounding boundary may move
        # by one token; measured: equal in all 120 rows
        assert torch.equal(got, expected)


def test_int32_hash_and_noise_equal_the_unsigned_reference():
    """The device hash works on int32 patterns (wrapping products, masked shifts); it must give the unsigned
    32-bit function of the host side bit for bit, so the sign bit and the wrap-around are covered."""
    values = [0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0x5BD1E995, 123456789, 0xDEADBEEF]
    got = mix32(as_int32(torch.tensor(values, dtype=torch.int64))).long() & 0xFFFFFFFF
    assert got.tolist() == [_mix32_int(v) for v in values]

    seeds = torch.tensor([0, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF], dtype=torch.int64)
    index = torch.tensor([0, 5, 4095, 1], dtype=torch.int64)
    vocab = 300
    noise = gumbel_noise(seeds, index, vocab_hashes(vocab, "cpu"))
    for row, (seed, i) in enumerate(zip(seeds.tolist(), index.tolist())):
        stream = _mix32_int(seed ^ _mix32_int(i))
        bits = torch.tensor([_mix32_int(stream ^ _mix32_int((v + 0x5BD1E995) & 0xFFFFFFFF)) >> 8 for v in range(vocab)])
        u = (bits.float() + 0.5) * (1.0 / (1 << 24))
        assert torch.equal(noise[row], -torch.log(-torch.log(u)))


def test_gumbel_sampling_draws_from_the_filtered_softmax():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = probs.log()[None].expand(40_000, -1)
    hashes = vocab_hashes(6, "cpu")
    seeds = torch.arange(40_000, dtype=torch.int64) * 7919 % (1 << 32)
    index = torch.zeros(40_000, dtype=torch.int64)

    def freqs(**kw):
        tokens, logprobs = sample_tokens(logits, 1.0, seeds, index, hashes, greedy=False, **kw)
        torch.testing.assert_close(logprobs, probs.log()[tokens])  # untruncated log-probs
        return torch.bincount(tokens, minlength=6).float() / tokens.numel()

    # 40k draws: standard error <= 0.0025; 4 standard errors (measured 0.0028, 0.0023, 0.0023)
    torch.testing.assert_close(freqs(), probs, atol=0.01, rtol=0)
    top2 = torch.tensor([0.4, 0.25, 0, 0, 0, 0]) / 0.65
    torch.testing.assert_close(freqs(top_k=2), top2, atol=0.01, rtol=0)
    torch.testing.assert_close(freqs(top_p=torch.tensor(0.6)), top2, atol=0.01, rtol=0)
    # the next response position draws independently of this one
    again, _ = sample_tokens(logits, 1.0, seeds, index + 1, hashes, greedy=False)
    first, _ = sample_tokens(logits, 1.0, seeds, index, hashes, greedy=False)
    assert 0.2 < (again == first).float().mean() < 0.3  # sum p^2 = 0.25 for independent draws


def test_sample_tokens_greedy_logprob_is_untempered():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
    tok, lp = sample_tokens(logits, 0.5, None, None, None, greedy=True)
    assert tok.tolist() == [0, 1]
    torch.testing.assert_close(lp, logits.log_softmax(-1)[[0, 1], [0, 1]])


def test_slot_cache_copies_prefixes_and_recycles_slots():
    cache = SlotCache(CFG, num_slots=3, slot_len=8, device=torch.device("cpu"), dtype=torch.float32)
    cache.k.normal_()
    a, b, c = cache.allocate(3)
    assert (a, b, c) == (0, 1, 2) and cache.num_free == 0
    cache.copy_prefix([a, a], [b, c], 5)
    rows = lambda s, n: cache.k[:, cache.base(s) : cache.base(s) + n]  # noqa: E731
    assert torch.equal(rows(b, 5), rows(a, 5)) and torch.equal(rows(c, 5), rows(a, 5))
    assert not torch.equal(rows(b, 8), rows(a, 8))
    cache.release([b])
    assert cache.allocate(1) == [b]
    with pytest.raises(ValueError, match="free"):
        cache.allocate(1)


def test_cache_plan_counts_the_cache_it_replaces_and_nothing_else_held_unused(monkeypatch):
    """A cache dropped for longer slots stays reserved by torch's allocator: the next plan counts it, or every
    reallocation shrinks the cache by the size of the one before; memory the allocator holds unused for others
    (the trainer's) stays out of the budget."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 40 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 15 * gib)  # 25 GiB held unused
    cuda = torch.device("cuda")
    per_slot = 1024 * kv_bytes_per_token(CFG, torch.bfloat16)
    fit = lambda gibs: int(gibs * gib * 0.5) // per_slot - 1  # noqa: E731  (the scratch slot)
    assert plan_slots(CFG, 1024, 10**9, cuda, torch.bfloat16, 0.5) == fit(10)
    assert plan_slots(CFG, 1024, 10**9, cuda, torch.bfloat16, 0.5, replaced_bytes=18 * gib) == fit(28)
    assert plan_slots(CFG, 1024, 10**9, cuda, torch.bfloat16, 0.5, replaced_bytes=30 * gib) == fit(35)  # capped
    assert plan_slots(CFG, 1024, 7, cuda, torch.bfloat16, 0.5, replaced_bytes=18 * gib) == 7
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 80 * gib))
    with pytest.raises(ValueError, match="rollout.gpu_memory_fraction"):
        plan_slots(CFG, 1024, 8, cuda, torch.bfloat16, 0.5)


def test_a_cache_replaced_for_longer_slots_is_freed_before_the_new_one_is_planned(monkeypatch):
    import weakref

    from slipstream.rollout import builtin

    engine = _engine(max_batch_size=4)
    engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2))
    old, old_bytes = weakref.ref(engine.cache), engine.cache.nbytes
    seen = []
    plan = builtin.plan_slots

    def spy(*args):
        seen.append((old() is None, args[-1]))
        return plan(*args)

    monkeypatch.setattr(builtin, "plan_slots", spy)
    engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=300))  # longer than the first call's slots
    # planned once, with the old cache already gone and its bytes counted as the budget's to reuse
    # (one slot for the one sample + the scratch slot) x 256 tokens of keys and values
    assert seen == [(True, old_bytes)] and old_bytes == 2 * 256 * kv_bytes_per_token(CFG, torch.float32)


def test_pack_prefill_hand_computed():
    # slot at cache row 100: a whole prompt; slot at row 200: a prompt's tokens 2..4 (a chunk after the first)
    tokens, seqs = pack_prefill([(100, (7, 8, 9), 0, 3), (200, (1, 2, 3, 4, 5), 2, 5)], 1000)
    assert tokens.tolist() == [[7, 8, 9, 3, 4, 5], [0, 1, 2, 2, 3, 4], [100, 101, 102, 202, 203, 204]]
    assert seqs.dtype == torch.int32 and seqs.tolist() == [[0, 3, 6], [100, 200, 1000], [3, 5, 0]]


def test_decode_buckets_cover_every_batch_size():
    for max_rows in (1, 5, 64, 100, 256, 1000):
        buckets = decode_buckets(max_rows)
        assert buckets[-1] == max_rows and buckets == sorted(set(buckets)) and buckets[0] == 1


def test_sampling_params_validation():
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(max_new_tokens=0), dict(n=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams(stop_token_ids=[2, 5]).stop_token_ids == (2, 5)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        _engine().generate([[1] * 10], SamplingParams(max_new_tokens=CFG.max_position_embeddings))
    with pytest.raises(ValueError, match="at least one token"):
        _engine().generate([[]], SamplingParams())


@pytest.mark.parametrize("overlap", [False, True])
def test_reprefill_on_weight_update_makes_later_tokens_the_new_policy_s(overlap):
    """rollout.on_weight_update=reprefill: in-flight samples recompute their prefix with the new weights, so
    each token and its behaviour log-prob come from exactly the policy version it is tagged with (overlapped,
    the queued ring is read first: its tokens are the old weights')."""
    from slipstream.rollout.core import Request

    engine = _engine(max_batch_size=4, decode_steps_per_sync=2, on_weight_update="reprefill", overlap_decode=overlap)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=7)
    old_model = Transformer(CFG)
    old_model.load_state_dict(engine.model.state_dict())
    core = engine._core_for(16, 2)
    core.configure(sampling, engine.version)
    core.add([Request((1, 17, 23), (7, 7), key=5)])
    core.step()  # prefill: token 0 of both samples
    core.step()  # decode: tokens 1, 2
    new = _weights(7)
    engine.update_weights(iter_hf_weights(new), version=4)
    finished = []
    while core.has_work:
        finished += core.step()
    for seq in finished:
        assert seq.versions == ([3] * 5 + [4] * 2 if overlap else [3] * 3 + [4] * 4)
        ids = [1, 17, 23, *seq.tokens]
        for j, (tok, lp, version) in enumerate(zip(seq.tokens, seq.logprobs, seq.versions)):
            model = old_model if version == 3 else new
            ref = _full_logits(model, ids[: 3 + j])[-1].log_softmax(-1)[tok]
            assert abs(lp - float(ref)) < 1e-5  # measured max 2e-6 (fp32)


def test_decode_graphs_only_where_decode_attention_has_no_host_sync(monkeypatch):
    from slipstream.ops import attention, decode_attention

    cuda = torch.device("cuda")
    monkeypatch.setattr(decode_attention, "available", lambda: True)
    assert attention.decode_capturable(cuda, torch.float32, "triton")  # exact fp32 kernel: a float32 rollout graphs
    assert attention.decode_capturable(cuda, torch.bfloat16, "flash")
    assert not attention.decode_capturable(cuda, torch.float32, "flash")  # the per-sequence loop reads lengths
    assert not attention.decode_capturable(torch.device("cpu"), torch.bfloat16, "triton")
    monkeypatch.setattr(decode_attention, "available", lambda: False)  # no triton: flash decodes bf16, fp32 loops
    assert attention.decode_capturable(cuda, torch.bfloat16, "triton")
    assert not attention.decode_capturable(cuda, torch.float32, "triton")


def test_append_takes_tokens_up_to_a_stop_or_the_budget_as_the_per_token_rule_does():
    # The host's per-ring step, vectorised, against the rule written token by token: a stop token is
    # kept and ends the sample ("stop", also when it is the budget's last token), else the budget ends it.
    import random

    from slipstream.rollout.core import EngineCore, Request, Sequence

    rng = random.Random(0)
    cfg = get_preset("tiny")
    for trial in range(200):
        n, k = rng.randint(1, 6), rng.randint(1, 5)
        stops = rng.sample(range(8), rng.randint(0, 2))
        core = EngineCore.__new__(EngineCore)  # the bookkeeping only: no model, a one-slot-per-sample cache
        core.cache, core.version = SlotCache(cfg, n, 4, torch.device("cpu"), torch.float32), 7
        core._stop_ids = torch.tensor(sorted(stops), dtype=torch.int64)
        seqs = []
        for i in range(n):
            done = rng.randint(0, 3)
            seq = Sequence(Request((1,), (done + rng.randint(1, 6),), key=i), 0, seed=0, slot=core.cache.allocate(1)[0])
            seq.tokens, seq.logprobs, seq.versions = [9] * done, [0.5] * done, [6] * done
            seqs.append(seq)
        core.running = list(seqs)
        tokens, logprobs = torch.randint(0, 8, (n, k)), torch.rand(n, k)
        expected = []
        for seq, toks, lps in zip(seqs, tokens.tolist(), logprobs.tolist()):
            got, reason = [], None
            for tok, lp in zip(toks, lps):
                got.append((tok, lp))
                reason = "stop" if tok in stops else ("length" if len(seq.tokens) + len(got) >= seq.budget else None)
                if reason:
                    break
            expected.append((seq.tokens + [t for t, _ in got], seq.logprobs + [lp for _, lp in got],
                             seq.versions + [7] * len(got), reason))  # fmt: skip
        finished = core._append(seqs, tokens, logprobs)
        for seq, want in zip(seqs, expected):
            assert (seq.tokens, seq.logprobs, seq.versions, seq.finish_reason) == want, trial
        assert finished == [s for s in seqs if s.finish_reason]
        assert core.running == [s for s in seqs if not s.finish_reason]


def test_compiled_layers_write_the_cache_and_compile_once_for_every_layer():
    # rollout.compile on the CPU (inductor's C++ backend): the cache write inside the compiled pre-attention
    # function must land in the cache itself (not a functional copy), and one compilation of each function
    # must serve every layer, prefill and decode, and every batch size (a recompile per layer would exceed
    # dynamo's limit and fall back to eager on a 28-layer model)
    import dataclasses

    from torch._dynamo.utils import counters

    cfg = dataclasses.replace(CFG, num_layers=12)
    # 9 prompt tokens, decode batches of 8: no size equals the head dim (16), which dynamo would tie to it
    prompts, sampling = [PROMPTS[0], PROMPTS[2]], SamplingParams(temperature=0.0, max_new_tokens=9, n=3)

    def run(compile: bool):
        engine = BuiltinRollout(cfg, max_batch_size=8, seed=0, compile=compile)
        return [(s.response_ids, s.behav_logprobs) for g in engine.generate(prompts, sampling) for s in g]

    eager = run(False)
    torch._dynamo.reset()
    counters.clear()
    compiled = run(True)
    assert counters["frames"]["ok"] == 3  # pre-attention, post-attention, sampler
    assert [ids for ids, _ in compiled] == [ids for ids, _ in eager]
    # measured max |diff| 4.8e-07 (fp32, inductor's fused reductions); 10x margin
    diff = max(abs(a - b) for (_, x), (_, y) in zip(compiled, eager) for a, b in zip(x, y))
    assert diff < 5e-6


def test_compiled_residual_adds_are_not_folded_into_the_projection_gemms():
    # bf16: the rollout's residual add rounds as the trainer's `x + branch` (bit for bit), and under compile it
    # stays a pointwise add fused into the next norm; folded into the o_proj / down GEMMs as addmm (inductor's
    # default for `h + mm`), cuBLAS would copy h into the output first and add the unrounded product
    from torch._inductor.utils import run_and_get_code

    from slipstream.rollout.model_runner import _post_attention, _residual_add, fuse_projections

    gen = torch.Generator().manual_seed(0)
    h, branch = (torch.randn(64, 96, generator=gen).to(torch.bfloat16) * s for s in (3.0, 0.01))
    assert torch.equal(_residual_add(h, branch), h + branch)
    assert not torch.equal(_residual_add(h, branch), h)  # the branch is not lost to rounding

    torch._dynamo.reset()
    model = _weights().to(torch.bfloat16)
    gate_up = fuse_projections(model)[0][2]
    x = torch.randn(7, CFG.hidden_size, generator=gen).to(torch.bfloat16)
    attn = torch.randn(7, CFG.num_heads, CFG.head_dim, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        _, code = run_and_get_code(
            torch.compile(_post_attention, dynamic=True), model.layers[0], gate_up, model.layers[1].input_layernorm, x, attn
        )
    source = "\n".join(code)
    assert source.count("extern_kernels.mm(") == 3 and "addmm" not in source  # o_proj, gate/up, down


@pytest.mark.parametrize("rows, budget", [(8, 64), (3, 50)])
def test_warmup_prefill_is_one_forward_of_the_whole_token_budget(rows, budget):
    """The CUDA warm-up's prefill fills one forward with `prefill_tokens` tokens (the shapes whose kernels and
    activation memory a first timed call would otherwise pay for), then the engine still generates."""
    engine = _engine(max_batch_size=rows, prefill_tokens=budget)
    tokens_per_forward = []
    forward = engine.runner.forward
    engine.runner.forward = lambda cache, input_ids, *a, **k: (  # noqa: E731
        tokens_per_forward.append(len(input_ids)) or forward(cache, input_ids, *a, **k)
    )
    engine.fill_prefill_budget(SamplingParams(temperature=1.0, max_new_tokens=4))
    assert tokens_per_forward == [budget]
    engine.warmup(SamplingParams(temperature=1.0, max_new_tokens=4))
    assert engine.cache is None and engine.startup_s > 0  # the next generation sizes its own cache
    assert _ids(engine.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_new_tokens=3), keys=[0, 1]))


def _samples(out):
    return [[(s.response_ids, s.behav_logprobs, s.finish_reason, s.token_versions) for s in g] for g in out]


@pytest.mark.parametrize("slots,ring,prefill", [(16, 3, 64), (4, 2, 5), (3, 16, 64), (1, 1, 4)])
def test_overlapped_decode_samples_exactly_what_the_one_ring_at_a_time_decode_does(slots, ring, prefill):
    """rollout.overlap_decode queues the next ring before reading the last (rows that stopped run on, their
    tokens dropped; compaction on the device; a prefill queued behind a ring): the samples, finish reasons and
    versions stay the same, with stop tokens, mixed budgets and more samples than slots (admission between
    rings), and so do the log-probs but for the last bits where admission comes a ring later (other batches)."""
    budgets = [[6, 2, 9], [1, 5, 3], [4, 4, 8], [3, 7, 1], [2, 6, 5]]
    base = _engine(max_batch_size=slots, decode_steps_per_sync=ring, prefill_tokens=prefill)
    free_run = _ids(base.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=9, n=3), budgets=budgets))
    stops = [free_run[0][0][1], free_run[2][2][4]]  # tokens the samples do produce: some stop early
    for sampling in (SamplingParams(temperature=1.0, max_new_tokens=9, n=3, stop_token_ids=stops),
                     SamplingParams(temperature=0.0, max_new_tokens=9, n=3)):  # fmt: skip
        expected = base.generate(PROMPTS, sampling, budgets=budgets, keys=[7, 8, 9, 10, 11])
        overlapped = _engine(max_batch_size=slots, decode_steps_per_sync=ring, prefill_tokens=prefill,
                             overlap_decode=True)  # fmt: skip
        got = overlapped.generate(PROMPTS, sampling, budgets=budgets, keys=[7, 8, 9, 10, 11])
        exact = lambda out: [[(s.response_ids, s.finish_reason, s.token_versions) for s in g] for g in out]  # noqa: E731
        assert exact(got) == exact(expected)
        for a, b in zip(sum(got, []), sum(expected, [])):  # measured max |diff| 2.9e-6 (4 slots); 3x margin
            torch.testing.assert_close(torch.tensor(a.behav_logprobs), torch.tensor(b.behav_logprobs), atol=1e-5, rtol=0)
        if slots >= 15:  # all samples admitted at once: the same batches, bit for bit
            assert _samples(got) == _samples(expected)
        assert any(s.finish_reason == "stop" for g in expected for s in g) or not sampling.stop_token_ids
        assert not overlapped.core._inflight  # rings queued past the last look ran before generate returned
        # and again on the same engine (rings left queued by the last call hold nothing to read)
        again = overlapped.generate(PROMPTS[:2], sampling, budgets=budgets[:2], keys=[7, 8])
        assert exact(again) == exact(expected[:2])
        for a, b in zip(sum(again, []), sum(expected[:2], [])):  # another crowd: GEMM blocking moves the last bits
            torch.testing.assert_close(torch.tensor(a.behav_logprobs), torch.tensor(b.behav_logprobs), atol=1e-5, rtol=0)


def test_overlapped_decode_queues_the_next_ring_before_reading_the_last(monkeypatch):
    """The order of device work and host reads: with overlap, ring i + 1 is queued before ring i is read; a
    request admitted meanwhile is prefilled behind the queued ring, which is read after the prefill."""
    from slipstream.rollout import decode_state

    from slipstream.rollout.core import EngineCore

    events = []
    wait, prefill = decode_state.PendingRead.wait, EngineCore._prefill
    monkeypatch.setattr(decode_state.PendingRead, "wait", lambda self: events.append("read") or wait(self))
    monkeypatch.setattr(EngineCore, "_prefill", lambda self, groups: events.append("prefill") or prefill(self, groups))
    engine = _engine(max_batch_size=2, decode_steps_per_sync=2, overlap_decode=True)
    run_decode = engine.runner.run_decode
    engine.runner.run_decode = lambda *a: events.append(f"ring of {a[2]}") or run_decode(*a)  # noqa: E731 (rows)
    # 2 slots, 2 prompts: nothing waits once both are in; budgets of 9 = 4 rings after the prefill's token
    engine.generate(PROMPTS[:2], SamplingParams(temperature=1.0, max_new_tokens=9))
    assert events == ["prefill", "ring of 2", "ring of 2", "read", "ring of 2", "read", "ring of 2", "read", "read"]
    events.clear()
    # 3 prompts for 2 slots: the first ends in ring 0, so ring 1 (queued before ring 0 is read) runs the second
    # alone; the third takes the freed slot, its prefill goes behind ring 1, which is read right after it, and
    # the next rings run the second and the third together
    engine.generate(PROMPTS[:3], SamplingParams(temperature=1.0, max_new_tokens=9), budgets=[[3], [9], [5]])
    assert events == ["prefill", "ring of 2", "ring of 1", "read", "prefill", "read", "ring of 2", "ring of 2",
                      "read", "read"]  # fmt: skip


def test_a_ring_queued_past_the_last_stop_has_run_before_the_engine_is_idle(monkeypatch):
    """The last running sample stops in the ring being read while the next ring is queued: that ring holds only
    stopped rows (nothing to read), but the engine reports no work only after it has run, since the cache and the
    decode state may be freed or handed to another stream next."""
    from slipstream.rollout import decode_state

    engine = _engine(max_batch_size=2, decode_steps_per_sync=1, overlap_decode=True)
    free = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=9))[0][0].response_ids
    j = next(i for i in range(1, 9) if free[i] not in free[:i])
    calls = []
    sync, wait = decode_state.PendingRead.synchronize, decode_state.PendingRead.wait
    monkeypatch.setattr(decode_state.PendingRead, "synchronize", lambda self: calls.append("sync") or sync(self))
    monkeypatch.setattr(decode_state.PendingRead, "wait", lambda self: calls.append("read") or wait(self))
    stopping = SamplingParams(temperature=0.0, max_new_tokens=9, stop_token_ids=[free[j]])
    [[sample]] = engine.generate([PROMPTS[0]], stopping)
    assert sample.response_ids == free[: j + 1] and sample.finish_reason == "stop"
    assert not engine.core._inflight and not engine.has_work
    # one read per ring up to the stop (each waits for its copy), then one wait for the ring queued after it
    assert calls == ["read", "sync"] * j + ["sync"]
