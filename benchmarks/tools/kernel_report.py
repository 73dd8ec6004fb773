"""Compile the rollout's Triton kernels for an H100 / H200 (sm_90) on any machine, GPU or not, and report what
the compiler made of them: registers, spills, shared memory, and how the global loads and stores came out.

    python benchmarks/tools/kernel_report.py

Needs triton (3.6's `ASTSource` API) with its bundled ptxas; no GPU. Each kernel is compiled with the
launch the code uses (`ops/sampling.py:HEAD_LAUNCH`, `ops/decode_attention.py:LAUNCH`, ...) at qwen3-0.6b's
shapes, with the divisibility by 16 that Triton infers at run time for the pointers and the specialised
integer arguments. What to look for: spills (registers past 255), `ld.global.b16` / `.b32` where a tile
load should be `v4` (a run-time size the compiler cannot prove a multiple of 16 defeats vectorisation),
no `cp.async` where a pipelined matmul loop is expected, and shared memory that caps the programs per SM
(228 KB per SM on the H100 / H200).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from slipstream.ops import decode_attention, layer_kernels, sampling

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def compile_for_sm90(fn, types: dict[str, str], consts: dict, aligned: set[str], num_warps: int, num_stages: int):
    """`fn` compiled for sm_90: `types` of the pointer / float arguments (others are i32), `consts` the
    constexprs, `aligned` the arguments known to be multiples of 16 (pointers: 16-byte aligned)."""
    names = fn.arg_names
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in aligned}
    source = ASTSource(fn, signature, {(names.index(k),): v for k, v in consts.items()}, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})


def describe(kernel) -> dict:
    """Registers / spills (ptxas -v), shared memory, and the counts of each kind of global load / store / async copy."""
    ptx = kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    info = subprocess.run([str(PTXAS), "-v", "--gpu-name=sm_90a", f.name, "-o", "/dev/null"], capture_output=True, text=True)
    Path(f.name).unlink()
    registers = re.search(r"Used (\d+) registers", info.stderr)
    spills = re.search(r"(\d+) bytes spill stores", info.stderr)
    count = lambda pattern: dict(Counter(re.findall(pattern, ptx)))  # noqa: E731
    return {
        "registers": int(registers.group(1)) if registers else None,
        "spill_bytes": int(spills.group(1)) if spills else None,
        "shared_bytes": kernel.metadata.shared,
        "loads": count(r"ld\.global[.\w]*"),
        "stores": count(r"st\.global[.\w]*"),
        "async_copies": count(r"cp\.async\.c[ga]\.shared\.global"),
    }


def kernels() -> dict[str, object]:
    """The rollout's kernels at their launches (qwen3-0.6b: 16 query heads on 8 kv heads, head dim 128)."""
    fp32_ptr, i64_ptr, i32_ptr, bf16_ptr = "*fp32", "*i64", "*i32", "*bf16"
    out = {}
    keys = {"Temperature": fp32_ptr, "Seeds": i64_ptr, "TokenIndex": i64_ptr, "VocabHash": i32_ptr, "Part": fp32_ptr}
    types = {"Logits": fp32_ptr, **keys}
    out["sampling._chunk_kernel"] = compile_for_sm90(
        sampling._chunk_kernel, types, {"BLOCK": sampling.BLOCK, "NOISE": True}, set(types) | {"stride_lb", "V", "CHUNK"}, 8, 3
    )  # fmt: skip
    launch = sampling.HEAD_LAUNCH
    types = {"H": bf16_ptr, "W": bf16_ptr, **keys}
    out["sampling._head_kernel"] = compile_for_sm90(
        sampling._head_kernel, types,
        {"BLOCK_M": launch["block_m"], "BLOCK_N": launch["block_n"], "BLOCK_K": launch["block_k"], "NOISE": True},
        set(types) | {"stride_h", "stride_w", "V", "K", "COLS"}, launch["num_warps"], launch["num_stages"],
    )  # fmt: skip
    types = {n: bf16_ptr for n in ("QKV", "QW", "KW", "Cos", "Sin", "Q", "KCache", "VCache")} | {"WriteIndex": i64_ptr, "eps": "fp32"}
    strides = {n for n in layer_kernels._qkv_heads_kernel.arg_names if n.startswith("stride")}
    out["layer_kernels._qkv_heads_kernel"] = compile_for_sm90(
        layer_kernels._qkv_heads_kernel, types, {"HQ": 16, "HKV": 8, "HQ_P2": 16, "HKV_P2": 8, "D": 128, "NORM": True},
        (set(types) - {"eps"}) | strides, 4, 1,
    )  # fmt: skip
    types = {"X": bf16_ptr, "Out": bf16_ptr}
    out["layer_kernels._silu_mul_kernel"] = compile_for_sm90(
        layer_kernels._silu_mul_kernel, types, {"BLOCK": layer_kernels.SILU_BLOCK}, set(types) | {"stride_x", "stride_o", "I"}, 4, 1
    )  # fmt: skip
    launch = decode_attention.LAUNCH
    types = {n: bf16_ptr for n in ("Q", "K", "V", "Out")} | {n: i32_ptr for n in ("Starts", "Lengths", "Order")}
    types |= {"Acc": fp32_ptr, "ML": fp32_ptr, "scale": "fp32"}
    strides = {n for n in decode_attention._split_kernel.arg_names if n.startswith("stride")}
    out["decode_attention._split_kernel"] = compile_for_sm90(
        decode_attention._split_kernel, types,
        {"GROUP": 2, "BLOCK_G": 16, "BLOCK_N": launch["block_n"], "D": 128, "NUM_SPLITS": 1, "PRECISION": "tf32",
         "HEADS_FIRST": bool(launch["heads_first"]), "ORDERED": bool(launch["longest_first"])},
        (set(types) - {"scale"}) | strides, launch["num_warps"], launch["num_stages"],
    )  # fmt: skip
    return out


def main() -> None:
    print("kernel | registers | spill B | shared B | global loads | global stores | async copies")
    for name, kernel in kernels().items():
        d = describe(kernel)
        show = lambda counts: ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "-"  # noqa: E731
        print(f"{name} | {d['registers']} | {d['spill_bytes']} | {d['shared_bytes']} | {show(d['loads'])} | "
              f"{show(d['stores'])} | {show(d['async_copies'])}")  # fmt: skip


if __name__ == "__main__":
    main()
