"""One-pass sampling over fp32 logits in Triton: the Gumbel-max draw and the behaviour log-prob together.

`rollout/sampler.py:sample_tokens` without top-k / top-p is, per row,

    scaled = logits / T,   lse = logsumexp(scaled),   token = argmax(scaled + g),   logprob = scaled[token] - lse

with the keyed Gumbel noise g of `rollout/sampler.py:gumbel_noise`. Compiled with torch that is three
passes over the (B, V) logits (the max and the exp-sum of logsumexp, then the noisy argmax), and the
noise hash runs in the third. Here one pass does all of it: each program reads a chunk of a row's
vocabulary once, keeping an online logsumexp (running max m and sum l) and the best noisy value with
its token and its scaled logit, per lane of its block (no cross-thread reduction inside the loop: the
lanes are reduced once at the end); a second small kernel merges the chunks of each row. Greedy rows
(`NOISE=False`) take the plain argmax and the log-prob at temperature 1, as `sample_tokens` does.

The same function as `sample_tokens` up to rounding: the scaled logits and the noise bits are the same
bit for bit, the logs may differ in the last ulp and the online logsumexp adds in another order (about
1e-7 relative). Logits of -inf (masked entries) are handled as torch handles them. Ties go to the lowest
token id, as torch's argmax.
"""

from __future__ import annotations

import torch

from slipstream.ops.decode_attention import available, sm_count, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _mix32(x):
        """`rollout/sampler.py:mix32` on int32 (wrapping products, shifts made logical by masks)."""
        x = x ^ ((x >> 16) & 0xFFFF)
        x = x * 0x7FEB352D
        x = x ^ ((x >> 15) & 0x1FFFF)
        x = x * -2073254261  # 0x846CA68B as a signed int32
        return x ^ ((x >> 16) & 0xFFFF)

    # V and CHUNK stay specialised (a multiple of 16 lets the loads vectorise); CHUNK is a whole number of blocks,
    # so every row count launches the same compiled kernel
    @triton.jit(do_not_specialize=["NUM_CHUNKS"])
    def _chunk_kernel(
        Logits, Temperature, Seeds, TokenIndex, VocabHash, Part, stride_lb, V, CHUNK, NUM_CHUNKS,
        BLOCK: tl.constexpr, NOISE: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        c = tl.program_id(1)
        if NOISE:
            t = tl.load(Temperature)
            seed = tl.load(Seeds + b).to(tl.int32)  # the low 32 bits, as sampler.as_int32
            index = tl.load(TokenIndex + b).to(tl.int32)
            stream = _mix32(seed ^ _mix32(index))
        lo = c * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        # per-lane state (lane j sees tokens lo + j, lo + j + BLOCK, ...), reduced across lanes once at the end:
        # the loop itself has no cross-thread reduction
        m = tl.full((BLOCK,), float("-inf"), tl.float32)  # running max of the scaled logits
        l = tl.zeros((BLOCK,), tl.float32)  # noqa: E741  running sum of exp(scaled - m)
        best = tl.full((BLOCK,), float("-inf"), tl.float32)  # best noisy value, its token and its scaled logit
        best_token = tl.zeros((BLOCK,), tl.int32)
        best_scaled = tl.zeros((BLOCK,), tl.float32)
        for v0 in range(lo, hi, BLOCK):
            v = v0 + tl.arange(0, BLOCK)
            valid = v < hi
            x = tl.load(Logits + b.to(tl.int64) * stride_lb + v, mask=valid, other=float("-inf"))
            if NOISE:
                scaled = tl.div_rn(x, t)  # rounded as torch's division (plain `/` may be 2 ulp off)
                bits = (_mix32(stream ^ tl.load(VocabHash + v, mask=valid, other=0)) >> 8) & 0xFFFFFF
                u = (bits.to(tl.float32) + 0.5) * (1.0 / 16777216.0)
                y = tl.where(valid, scaled - tl.log(-tl.log(u)), float("-inf"))
            else:
                scaled = x
                y = x
            # online logsumexp with one exp per entry: exp(-|scaled - m|) rescales the old sum when the entry is
            # the new max, else it is the entry's own term; both -inf (nothing seen yet) adds 0, not NaN
            m_new = tl.maximum(m, scaled)
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            e = tl.exp(tl.minimum(m, scaled) - shift)
            l = tl.where(scaled > m, l * e + 1.0, l + e)  # noqa: E741
            m = m_new
            take = y > best  # strictly: an equal value later in the lane has a higher token id
            best = tl.where(take, y, best)
            best_token = tl.where(take, v, best_token)
            best_scaled = tl.where(take, scaled, best_scaled)
        m_all = tl.max(m, 0)
        top = tl.where(m_all == float("-inf"), 0.0, m_all)
        l_all = tl.sum(l * tl.exp(m - top), 0)  # lanes that saw only -inf hold l = 0
        best_all = tl.max(best, 0)
        # the lowest token among the lanes holding the maximum (torch's argmax takes the first)
        token = tl.min(tl.where(best == best_all, best_token, 2147483647), 0)
        picked = (best == best_all) & (best_token == token)
        scaled_all = tl.max(tl.where(picked, best_scaled, float("-inf")), 0)
        part = Part + (b * NUM_CHUNKS + c) * 5
        tl.store(part, m_all)
        tl.store(part + 1, l_all)
        tl.store(part + 2, best_all)
        tl.store(part + 3, token.to(tl.float32))  # token ids < 2**24 are exact in fp32
        tl.store(part + 4, scaled_all)

    # V, K and COLS (whole tiles) stay specialised: with K a known multiple of 16 the tile loads vectorise and
    # pipeline (as run-time values they compiled to one 2-byte load per element, unpipelined)
    @triton.jit(do_not_specialize=["rows", "NUM_CHUNKS"])
    def _head_kernel(
        H, W, Temperature, Seeds, TokenIndex, VocabHash, Part, rows, V, K, stride_h, stride_w, COLS, NUM_CHUNKS,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NOISE: tl.constexpr,
    ):  # fmt: skip
        """`_chunk_kernel` on logits it computes itself: each program multiplies BLOCK_M rows of the hidden
        states by its slice of the LM head, tile by tile, and folds each fp32 tile into the rows' running
        statistics; the logits never reach memory."""
        pid_m = tl.program_id(0)
        c = tl.program_id(1)
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        r_ok = r < rows
        if NOISE:
            t = tl.load(Temperature)
            seed = tl.load(Seeds + r, mask=r_ok, other=0).to(tl.int32)  # the low 32 bits, as sampler.as_int32
            index = tl.load(TokenIndex + r, mask=r_ok, other=0).to(tl.int32)
            stream = _mix32(seed ^ _mix32(index))
        lo = c * COLS
        hi = tl.minimum(lo + COLS, V)
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_M,), tl.float32)  # noqa: E741
        best = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        best_token = tl.zeros((BLOCK_M,), tl.int32)
        best_scaled = tl.zeros((BLOCK_M,), tl.float32)
        k = tl.arange(0, BLOCK_K)
        h_rows = H + r.to(tl.int64)[:, None] * stride_h
        for n0 in range(lo, hi, BLOCK_N):
            v = n0 + tl.arange(0, BLOCK_N)
            valid = v < hi
            w_rows = W + v.to(tl.int64)[:, None] * stride_w
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_ok = (k0 + k) < K
                h = tl.load(h_rows + (k0 + k)[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_rows + (k0 + k)[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
                # "ieee": exact products for fp32 weights (no TF32); bf16 / fp16 multiply exactly anyway
                acc = tl.dot(h, tl.trans(w), acc, input_precision="ieee")
            x = tl.where(valid[None, :], acc, float("-inf"))
            if NOISE:
                scaled = tl.div_rn(x, t)
                hashes = tl.load(VocabHash + v, mask=valid, other=0)
                bits = (_mix32(stream[:, None] ^ hashes[None, :]) >> 8) & 0xFFFFFF
                u = (bits.to(tl.float32) + 0.5) * (1.0 / 16777216.0)
                y = tl.where(valid[None, :], scaled - tl.log(-tl.log(u)), float("-inf"))
            else:
                scaled = x
                y = x
            m_new = tl.maximum(m, tl.max(scaled, 1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # no inf - inf while a row has seen only -inf
            l = l * tl.exp(m - shift) + tl.sum(tl.exp(scaled - shift[:, None]), 1)  # noqa: E741
            m = m_new
            tile_best = tl.max(y, 1)
            tile_token = n0 + tl.argmax(y, 1)  # the first position of the maximum
            take = tile_best > best  # strictly: an equal value in a later tile has a higher token id
            tile_scaled = tl.sum(tl.where(v[None, :] == tile_token[:, None], scaled, 0.0), 1)
            best_scaled = tl.where(take, tile_scaled, best_scaled)
            best = tl.where(take, tile_best, best)
            best_token = tl.where(take, tile_token, best_token)
        part = Part + (r.to(tl.int64) * NUM_CHUNKS + c) * 5
        tl.store(part, m, mask=r_ok)
        tl.store(part + 1, l, mask=r_ok)
        tl.store(part + 2, best, mask=r_ok)
        tl.store(part + 3, best_token.to(tl.float32), mask=r_ok)
        tl.store(part + 4, best_scaled, mask=r_ok)

    @triton.jit(do_not_specialize=["NUM_CHUNKS"])
    def _merge_kernel(Part, Tokens, Logprobs, NUM_CHUNKS, MAX_CHUNKS: tl.constexpr):
        b = tl.program_id(0)
        c = tl.arange(0, MAX_CHUNKS)
        used = c < NUM_CHUNKS
        part = Part + (b * NUM_CHUNKS + c) * 5
        m = tl.load(part, mask=used, other=float("-inf"))
        l = tl.load(part + 1, mask=used, other=0.0)  # noqa: E741
        best = tl.load(part + 2, mask=used, other=float("-inf"))
        top = tl.max(m, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        lse = top + tl.log(tl.sum(tl.where(used, l * tl.exp(m - top), 0.0), 0))
        winner = tl.argmax(best, 0)  # the first chunk holding the maximum: the lowest token id
        token = tl.load(Part + (b * NUM_CHUNKS + winner) * 5 + 3)
        scaled = tl.load(Part + (b * NUM_CHUNKS + winner) * 5 + 4)
        tl.store(Tokens + b, token.to(tl.int64))
        tl.store(Logprobs + b, scaled - lse)


BLOCK = 2048
"""Vocabulary entries per inner iteration."""
MAX_CHUNKS = 32
"""Most programs per row. The chunk count is a run-time argument of both kernels (this bound is the merge's
compile-time width), so a new batch size launches the compiled kernels instead of compiling new ones: the
prefill of an RL step samples at row counts it has not seen."""


def _slices(vocab: int, wanted: int, tile: int) -> tuple[int, int]:
    """(count, length) of vocabulary slices: about `wanted` of them, each a whole number of `tile` entries."""
    per_slice = -(-vocab // wanted)
    length = -(-per_slice // tile) * tile
    return -(-vocab // length), length


def num_chunks(rows: int, vocab: int, device: torch.device) -> int:
    """Programs per row: enough for about four per SM over the batch, each at least a few blocks long."""
    return max(1, min(MAX_CHUNKS, -(-vocab // (4 * BLOCK)), -(-4 * sm_count(device) // max(1, rows))))


def _kernel_keys(seeds, token_index, vocab_hash, greedy: bool, device: torch.device):
    """The kernels' key pointers: checked, or for greedy rows (which draw no noise) any tensors of the right kind
    (empty: no memset in a captured step)."""
    if greedy:
        unused = torch.empty(1, dtype=torch.int64, device=device)
        return unused, unused, torch.empty(1, dtype=torch.int32, device=device)
    if vocab_hash.dtype != torch.int32 or not (seeds.is_contiguous() and token_index.is_contiguous()):
        raise ValueError("sampling kernels need sampler.vocab_hashes' int32 vocab_hash and contiguous seeds / token_index")
    return seeds, token_index, vocab_hash


def _sample_in_slices(launch, rows: int, slices: int, max_slices: int, seeds, token_index, vocab_hash, greedy: bool,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """What both entry points share: the (rows, slices, 5) partials, the keys, `launch(part, seeds, token_index,
    vocab_hash)` of the per-slice kernel, and the merge into tokens (B,) int64 and log-probs (B,) fp32."""
    part = torch.empty((rows, slices, 5), dtype=torch.float32, device=device)
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    launch(part, *_kernel_keys(seeds, token_index, vocab_hash, greedy, device))
    _merge_kernel[(rows,)](part, tokens, logprobs, slices, MAX_CHUNKS=max_slices)
    return tokens, logprobs


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor | None,
    token_index: torch.Tensor | None,
    vocab_hash: torch.Tensor | None,
    greedy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens(logits, temperature, seeds, token_index, vocab_hash, greedy)` without top-k / top-p, in
    two kernel launches; fp32 logits (B, V) -> (tokens (B,) int64, behaviour log-probs (B,) fp32)."""
    if not available():
        raise RuntimeError("sample_rows needs triton")
    rows, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"sample_rows needs fp32 logits with contiguous rows (got {logits.dtype})")
    chunks, chunk = _slices(vocab, num_chunks(rows, vocab, logits.device), BLOCK)

    def launch(part, seeds, token_index, vocab_hash):
        _chunk_kernel[(rows, chunks)](
            logits, temperature, seeds, token_index, vocab_hash, part, logits.stride(0), vocab, chunk,
            chunks, BLOCK=BLOCK, NOISE=not greedy, num_warps=8,
        )  # fmt: skip

    return _sample_in_slices(launch, rows, chunks, MAX_CHUNKS, seeds, token_index, vocab_hash, greedy, logits.device)


HEAD_LAUNCH = {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3, "programs_per_sm": 2}
"""Launch of the fused LM-head sampling kernel: rows and vocabulary entries per tile, hidden entries per step
of the matmul, warps, pipeline stages, and the programs per SM the vocabulary split aims for. Not yet tuned on
a GPU (`python benchmarks/tools/bench_sampling.py` times it against the LM-head matmul + `sample_rows`)."""
HEAD_MAX_SPLITS = 256
"""Most vocabulary slices per row in the fused kernel (the merge's compile-time width for it)."""


def head_splits(rows: int, vocab: int, device: torch.device) -> int:
    """Vocabulary slices per row for `sample_hidden`: about `programs_per_sm` programs per SM over the row blocks,
    each slice at least four tiles long."""
    blocks = -(-rows // HEAD_LAUNCH["block_m"])
    want = -(-HEAD_LAUNCH["programs_per_sm"] * sm_count(device) // blocks)
    return max(1, min(HEAD_MAX_SPLITS, -(-vocab // (4 * HEAD_LAUNCH["block_n"])), want))


def sample_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor | None,
    token_index: torch.Tensor | None,
    vocab_hash: torch.Tensor | None,
    greedy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_rows(mm_fp32(hidden, weight.t()), ...)` with the LM-head matmul inside the sampling kernel: hidden
    (B, H) and weight (V, H) of one dtype -> (tokens (B,) int64, behaviour log-probs (B,) fp32). The logits are
    the same fp32-accumulated products up to the order of the additions. The model runner samples through it
    with `rollout.fused_lm_head` (off: slower than the matmul + `sample_rows` on nano-vllm's workload)."""
    if not available():
        raise RuntimeError("sample_hidden needs triton")
    rows, size = hidden.shape
    vocab = weight.shape[0]
    if weight.shape[1] != size or weight.dtype != hidden.dtype or hidden.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"sample_hidden needs hidden (B, H) and weight (V, H) of one dtype with contiguous rows "
                         f"(got {tuple(hidden.shape)} {hidden.dtype}, {tuple(weight.shape)} {weight.dtype})")  # fmt: skip
    splits, cols = _slices(vocab, head_splits(rows, vocab, hidden.device), HEAD_LAUNCH["block_n"])

    def launch(part, seeds, token_index, vocab_hash):
        config = HEAD_LAUNCH
        _head_kernel[(-(-rows // config["block_m"]), splits)](
            hidden, weight, temperature, seeds, token_index, vocab_hash, part, rows, vocab, size, hidden.stride(0),
            weight.stride(0), cols, splits, BLOCK_M=config["block_m"], BLOCK_N=config["block_n"],
            BLOCK_K=config["block_k"], NOISE=not greedy, num_warps=config["num_warps"], num_stages=config["num_stages"],
        )  # fmt: skip

    return _sample_in_slices(launch, rows, splits, HEAD_MAX_SPLITS, seeds, token_index, vocab_hash, greedy, hidden.device)
