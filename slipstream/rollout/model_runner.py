"""Run the policy over the slot cache: packed prefill, and decode steps replayed from CUDA graphs.

The forward uses the native `Transformer`'s own modules (norms, projections, RoPE) and replaces
only the attention, which reads the slot cache through `ops/attention.py:cache_attention`. Each
decoder layer is split at the attention into two functions (pre: q/k/v, q/k norm, RoPE, the
cache write; post: output projection, residual, norm, MLP, residual, and the next layer's input
norm, so that the residual add and that norm fuse); with `compile` they run under torch.compile
(dynamic shapes: one compilation serves every layer, batch size and prompt length), which fuses
their pointwise work. The attention runs between them. With `layer_kernels` (rollout.layer_kernels) on CUDA,
the pre half is the q/k/v matmul and one Triton kernel, and the MLP activation is a Triton kernel
between the two compiled parts of the post half.

A decode step is the whole token step for a batch of B slots: embed, every layer, final norm, LM
head in fp32, sampling on the device, then the state advance (next input token, position,
response index) written into the step's own input buffers. So the step can be replayed k times
without the host; `decode_state.py:DecodeState` holds those buffers and the output ring the host reads
after k steps. On CUDA each (batch bucket, sampling mode) is captured once into a CUDA graph.
"""

from __future__ import annotations

import functools
import logging
import time

import torch
import torch.nn.functional as F

from slipstream.models.transformer import Transformer, rope_cos_sin, rope_inv_freq
from slipstream.ops.attention import cache_attention, decode_capturable
from slipstream.ops.decode_attention import LAUNCH, PROGRAMS_PER_SM, launch_order, parse_launch
from slipstream.ops import layer_kernels as layer_kernel_ops
from slipstream.ops import sampling
from slipstream.ops.logprobs import mm_fp32
from slipstream.rollout.decode_state import DecodeState
from slipstream.rollout.kv_cache import SlotCache
from slipstream.rollout.sampler import sample_tokens, vocab_hashes

log = logging.getLogger(__name__)


def _pre_attention(layer, qkv_weight, qkv_bias, x: torch.Tensor, cos, sin, k_cache, v_cache, write_index):
    """Normed input (T, H) of one layer -> q (T, Hq, D); its k / v (RoPE applied) go to the cache rows
    `write_index` (T,). One q/k/v matmul; under compile the q/k norms, the rotation and the cache write are
    one kernel."""
    attn = layer.self_attn
    q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    q, k, v = F.linear(x, qkv_weight, qkv_bias).split([q_size, kv_size, kv_size], dim=-1)
    q, k, v = attn.heads(q, k, v, cos, sin)
    k_cache.index_copy_(0, write_index, k)
    v_cache.index_copy_(0, write_index, v)
    return q


def _residual_add(h: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """h + branch, the stored sum rounded as the trainer's add (the two summed in fp32, rounded once to h's dtype).

    For bf16 / fp16 spelled with explicit fp32 casts, so that inductor does not fold the add into the branch's
    GEMM as addmm(h, ...): cuBLAS's beta = 1 first copies h into the output (two device-to-device copies per
    layer and decode step) and adds the unrounded product. As a plain add it fuses into the norm kernel that
    reads the sum next (which, fused, reads the fp32 sum before its rounding, as inductor keeps fused
    intermediates in fp32). In fp32 the plain add folds into addmm as before."""
    if h.dtype not in (torch.bfloat16, torch.float16):
        return h + branch
    return (h.float() + branch.float()).to(h.dtype)


def _post_attention(layer, gate_up_weight, next_norm, h: torch.Tensor, attn: torch.Tensor):
    """Residual stream (T, H) after one layer, from its input and its attention output (T, Hq, D), and that
    stream through `next_norm` (the next layer's input norm, or the final norm after the last layer): under
    compile each residual add and the norm after it are one kernel."""
    h, gate_up = _attention_out(layer, gate_up_weight, h, attn)
    gate, up = gate_up.chunk(2, dim=-1)
    return _mlp_out(layer, next_norm, h, F.silu(gate) * up)


def _pre_attention_kernels(layer, qkv_weight, qkv_bias, x: torch.Tensor, cos, sin, k_cache, v_cache, write_index):
    """`_pre_attention` as the q/k/v matmul and one Triton kernel (norms, RoPE, cache write)."""
    attn = layer.self_attn
    qkv = F.linear(x, qkv_weight, qkv_bias)
    norms = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps) if attn.qk_norm else (None, None, 0.0)
    return layer_kernel_ops.qkv_heads(
        qkv, attn.num_heads, attn.num_kv_heads, *norms, cos, sin, k_cache, v_cache, write_index
    )  # fmt: skip


def _attention_out(layer, gate_up_weight, h: torch.Tensor, attn: torch.Tensor):
    """The residual stream after the attention, and the gate/up projection of its norm (T, 2I)."""
    h = _residual_add(h, layer.self_attn.o_proj(attn.flatten(-2)))
    return h, F.linear(layer.post_attention_layernorm(h), gate_up_weight)


def _mlp_out(layer, next_norm, h: torch.Tensor, activation: torch.Tensor):
    """The residual stream after the MLP's down projection of `activation`, and that stream through `next_norm`."""
    h = _residual_add(h, layer.mlp.down_proj(activation))
    return h, next_norm(h)


def _post_attention_kernels(attention_out, mlp_out, layer, gate_up_weight, next_norm, h, attn):
    """`_post_attention` with `silu(gate) * up` as one Triton kernel between `attention_out` and `mlp_out`."""
    h, gate_up = attention_out(layer, gate_up_weight, h, attn)
    return mlp_out(layer, next_norm, h, layer_kernel_ops.silu_mul(gate_up))


def fuse_projections(
    model: Transformer, shapes: dict[str, torch.Size] | None = None
) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]:
    """Give each layer's q/k/v and gate/up weights one storage each; returns (qkv weight, qkv bias, gate_up weight).

    The module parameters become views into the fused tensors, so in-place weight updates (by
    name, as the trainer exports them) land in the fused storage, and the decode step runs one
    matmul where there were three (and two): fewer, larger GEMMs read the weights at a higher
    share of the memory bandwidth when the batch is small. Call again after `model.to()`, which
    gives every parameter storage of its own. With `shapes` (from `drop_parameters`) the fused
    storages are allocated uninitialised at those shapes instead of concatenating the parameters.
    """
    shape_of = None if shapes is None else {id(p): shapes[name] for name, p in model.named_parameters()}
    fused = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        parts = [attn.q_proj, attn.k_proj, attn.v_proj]
        qkv_weight = _fuse([m.weight for m in parts], shape_of)
        qkv_bias = _fuse([m.bias for m in parts], shape_of) if attn.q_proj.bias is not None else None
        fused.append((qkv_weight, qkv_bias, _fuse([mlp.gate_proj.weight, mlp.up_proj.weight], shape_of)))
    return fused


def drop_parameters(model: torch.nn.Module) -> dict[str, torch.Size]:
    """Free the storage of every parameter (each becomes an empty tensor on its device); returns their
    shapes for `allocate_parameters`. Buffers (rotary tables) stay."""
    shapes = {}
    for name, p in model.named_parameters():
        shapes[name] = p.shape
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return shapes


def allocate_parameters(model: torch.nn.Module, shapes: dict[str, torch.Size]) -> None:
    """Give every parameter dropped by `drop_parameters` and not yet given storage (by `fuse_projections`
    with the same shapes) new storage of its shape, uninitialised."""
    for name, p in model.named_parameters():
        if p.shape != shapes[name]:
            p.data = torch.empty(shapes[name], dtype=p.dtype, device=p.device)


def _fuse(params: list[torch.nn.Parameter], shape_of: dict[int, torch.Size] | None = None) -> torch.Tensor:
    shapes = [p.shape if shape_of is None else shape_of[id(p)] for p in params]
    if shape_of is None:
        whole = torch.cat([p.data for p in params])
    else:
        rows, like = sum(s[0] for s in shapes), params[0]
        whole = torch.empty((rows, *shapes[0][1:]), dtype=like.dtype, device=like.device)
    offset = 0
    for p, shape in zip(params, shapes):
        p.data = whole[offset : offset + shape[0]]
        offset += shape[0]
    return whole


class ModelRunner:
    """Forward passes of `model` over a `SlotCache`; owns the compiled layer halves and the decode graphs."""

    def __init__(
        self,
        model: Transformer,
        compile: bool = False,
        cuda_graphs: bool = False,
        decode_attention: str = "triton",
        *,
        layer_kernels: bool = True,
        fused_lm_head: bool = False,
        decode_launch: str | None = None,
        decode_programs_per_sm: int = PROGRAMS_PER_SM,
    ) -> None:
        """The keyword settings are the rollout section's fields of the same names (config/schema.py);
        `decode_launch` None is the kernel's default launch (ops/decode_attention.py:LAUNCH)."""
        self.model = model
        self.decode_attention = decode_attention
        self.decode_launch = dict(LAUNCH) if decode_launch is None else parse_launch(decode_launch)
        """Launch of the Triton decode-attention kernel (ops/decode_attention.py:LAUNCH's keys)."""
        self.decode_programs_per_sm = decode_programs_per_sm
        """Split programs per SM the decode kernel's split count aims for (ops/decode_attention.py:choose_splits)."""
        self.cfg = model.cfg
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.compile = compile
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        if self.cuda_graphs and not decode_capturable(self.device, self.dtype, decode_attention):
            log.warning(
                "rollout.cuda_graphs is off: decode attention in %s with rollout.decode_attention=%s reads the "
                "lengths on the host (use bfloat16, or the triton kernel)", str(self.dtype).removeprefix("torch."),
                decode_attention,
            )  # fmt: skip
            self.cuda_graphs = False
        maybe_compile = (lambda fn: torch.compile(fn, dynamic=True)) if compile else (lambda fn: fn)
        self._sample = maybe_compile(sample_tokens)
        self.layer_kernels = layer_kernels and self.device.type == "cuda" and layer_kernel_ops.available()
        """The element-wise work between the layers' GEMMs in Triton kernels (ops/layer_kernels.py; CUDA only)."""
        self.fused_lm_head = fused_lm_head
        """Sample through the fused LM-head kernel (ops/sampling.py:sample_hidden) where the kernels serve the mode."""
        if self.layer_kernels:
            self._pre = _pre_attention_kernels
            self._post = functools.partial(
                _post_attention_kernels, maybe_compile(_attention_out), maybe_compile(_mlp_out)
            )  # fmt: skip
        else:
            self._pre, self._post = maybe_compile(_pre_attention), maybe_compile(_post_attention)
        positions = torch.arange(self.cfg.max_position_embeddings, device=self.device)
        # RoPE tables indexed by position: the same values the training forward computes per call
        self.cos, self.sin = rope_cos_sin(positions, rope_inv_freq(self.cfg, self.device), self.dtype)
        self.vocab_hash = vocab_hashes(self.cfg.vocab_size, self.device)
        self.fused = fuse_projections(model)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.capture_s = 0.0
        """Seconds spent capturing decode graphs (with their warm-up runs, which compile new shapes)."""

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        cache: SlotCache,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        write_index: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        seqused_k: torch.Tensor,
        max_seqlen_q: int,
        causal: bool,
        order: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden (T, H) of packed new tokens (T,); their k/v go to cache rows `write_index` (T,).
        `order`: the decode-attention launch order of the step (`ops/decode_attention.py:launch_order`)."""
        model = self.model
        h = model.embed_tokens(input_ids)
        x = model.layers[0].input_layernorm(h)
        cos, sin = self.cos[positions], self.sin[positions]
        next_norms = [layer.input_layernorm for layer in model.layers[1:]] + [model.norm]
        for i, (layer, (qkv_w, qkv_b, gate_up_w), next_norm) in enumerate(zip(model.layers, self.fused, next_norms)):
            q = self._pre(layer, qkv_w, qkv_b, x, cos, sin, cache.k[i], cache.v[i], write_index)
            attn = cache_attention(
                q, cache.k[i], cache.v[i], cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, cache.slot_len, causal,
                decode_kernel=self.decode_attention, order=order, launch=self.decode_launch,
                programs_per_sm=self.decode_programs_per_sm,
            )  # fmt: skip
            h, x = self._post(layer, gate_up_w, next_norm, h, attn)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits from an fp32-accumulated matmul, as the trainer's fused log-prob op computes them."""
        return mm_fp32(hidden, self.model.lm_head_weight.t())

    def _kernel_sampling(self, mode: tuple[bool, int, bool]) -> bool:
        """Whether the Triton sampling kernels serve `mode`: on CUDA, without top-k / top-p."""
        _, top_k, use_top_p = mode
        return self.device.type == "cuda" and sampling.available() and not top_k and not use_top_p

    def sample(self, logits, state: DecodeState, seeds, token_index, mode: tuple[bool, int, bool]):
        """Tokens and behaviour log-probs of fp32 logits (B, V): on CUDA without top-k / top-p, the one-pass
        Triton kernel (one read of the logits instead of three); else `sample_tokens` (compiled with the layers)."""
        greedy, top_k, use_top_p = mode
        if self._kernel_sampling(mode):
            return sampling.sample_rows(logits, state.temperature, seeds, token_index, self.vocab_hash, greedy)
        top_p = state.top_p if use_top_p else 1.0
        return self._sample(logits, state.temperature, seeds, token_index, self.vocab_hash, greedy, top_k, top_p)

    def sample_hidden(self, hidden, state: DecodeState, seeds, token_index, mode: tuple[bool, int, bool]):
        """Tokens and behaviour log-probs from final-normed hidden states (B, H): the fp32 LM head then `sample`, or,
        with `fused_lm_head` where the kernels serve `mode`, one kernel that never writes the logits."""
        if self.fused_lm_head and self._kernel_sampling(mode):
            weight = self.model.lm_head_weight
            return sampling.sample_hidden(hidden, weight, state.temperature, seeds, token_index, self.vocab_hash, mode[0])
        return self.sample(self.logits(hidden), state, seeds, token_index, mode)

    # ------------------------------------------------------------------ decode
    def decode_step(self, cache: SlotCache, state: DecodeState, batch: int, mode: tuple[bool, int, bool]) -> None:
        """One token for the first `batch` rows of `state`, all on the device; outputs go to the ring."""
        s = state
        pos = s.positions[:batch]
        # a row past its slot's end (finished, waiting for the host to notice) rewrites the slot's
        # last row instead of spilling into the next slot
        in_slot = pos.clamp(max=cache.slot_len - 1)
        s.seqused[:batch].copy_(in_slot + 1)
        triton_decode = self.device.type == "cuda" and self.decode_attention == "triton"
        # one launch order per step, for every layer
        order = launch_order(s.seqused[:batch], self.decode_launch) if triton_decode else None
        hidden = self.forward(
            cache, s.input_ids[:batch], in_slot, s.bases[:batch] + in_slot, s.cu_q[: batch + 1],
            s.cu_k[: batch + 1], s.seqused[:batch], 1, causal=False, order=order,
        )  # fmt: skip
        tokens, logprobs = self.sample_hidden(hidden, s, s.seeds[:batch], s.token_index[:batch], mode)
        s.out_tokens[:, :batch].index_copy_(0, s.step, tokens[None])
        s.out_logprobs[:, :batch].index_copy_(0, s.step, logprobs[None])
        s.input_ids[:batch].copy_(tokens)
        s.positions[:batch].add_(1)
        s.token_index[:batch].add_(1)
        s.step.add_(1)

    def needs_capture(self, batch: int, mode: tuple) -> bool:
        """Whether the next `run_decode` of `batch` rows captures a graph first (and so synchronises the device)."""
        return self.cuda_graphs and (batch, mode) not in self.graphs

    def run_decode(
        self, cache: SlotCache, state: DecodeState, batch: int, mode: tuple, steps: int
    ) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """`steps` decode steps for `batch` rows (padded to its bucket by the caller); graphs on CUDA.

        Returns CUDA events around the replays (None without graphs): their elapsed time, read once the host
        has waited for the replays, is the ring's device time. The decode's wall time less the sum over rings
        is a lower bound on the time the device waited for the host (its looks at the tokens, slot reuse,
        launches); a span also holds any gap between two replays of the ring."""
        if not self.cuda_graphs:
            for _ in range(steps):
                self.decode_step(cache, state, batch, mode)
            return None
        graph = self.graphs.get((batch, mode))
        if graph is None:
            graph = self._capture(cache, state, batch, mode)
        stream = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(steps):
            graph.replay()
        end.record(stream)
        return start, end

    def _capture(self, cache: SlotCache, state: DecodeState, batch: int, mode: tuple) -> torch.cuda.CUDAGraph:
        """Capture one decode step of `batch` rows. The warm-up runs on a copy of the live state, so
        capturing in the middle of a generation changes nothing but the graph table."""
        start = time.perf_counter()
        saved = state.snapshot()
        state.point_at_scratch(cache, batch)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles (first call) and lets autotuned kernels settle
                self.decode_step(cache, state, batch, mode)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        state.point_at_scratch(cache, batch)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # thread_local: in async mode the trainer thread keeps working (host syncs, allocations) while the
        # producer thread captures; the default ("global") mode makes those calls fail the capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self.decode_step(cache, state, batch, mode)
        # the first launch of an instantiated graph also uploads it to the device: do that here, on the
        # scratch rows, so it is capture time and not the first decode step's
        graph.replay()
        state.restore(saved)
        self.graphs[(batch, mode)] = graph
        torch.cuda.synchronize(self.device)
        self.capture_s += time.perf_counter() - start
        return graph

    def drop_graphs(self) -> None:
        """Forget the captured graphs (the cache or the state buffers they point at are gone)."""
        self.graphs.clear()
        self._pool = None

    def refuse(self, shapes: dict[str, torch.Size] | None = None) -> None:
        """Fuse the projections again after the model moved, or allocate the fused storages at `shapes`
        after `drop_parameters` (wake); graphs must be recaptured."""
        self.drop_graphs()
        self.fused = fuse_projections(self.model, shapes)
