"""Why do FSDP2 with and without CPU offload end up with different tied-embedding weights? (GPU)

    python bench/diag_offload.py

Builds three engines on the tiny preset like tests/gpu/test_fsdp_gpu.py (plain, plain again,
offload) and, for two steps, prints per parameter the max |diff| of the gradients before the
optimizer step and of the weights after it: plain vs plain-again (run-to-run noise) and plain
vs offload. A real offload bug shows as a gradient or weight gap well above the noise.
"""

from __future__ import annotations

import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))

from test_fsdp_gpu import ACTOR, BF16, CAP, CUDA, LOSSES, full_grads, make_batch, make_model  # noqa: E402

from slipstream.engine.distributed import init_distributed  # noqa: E402
from slipstream.batching.shard import local_micro_batches  # noqa: E402
from slipstream.engine.fsdp import FSDPEngine  # noqa: E402


def main() -> None:
    init_distributed("cuda")
    engines = {
        "plain": FSDPEngine(make_model(), CUDA, BF16, 1.0, ACTOR, offload=False),
        "again": FSDPEngine(make_model(), CUDA, BF16, 1.0, ACTOR, offload=False),
        "offload": FSDPEngine(make_model(), CUDA, BF16, 1.0, ACTOR, offload=True),
    }
    for step, (seed, loss) in enumerate(((1, LOSSES[0]), (2, LOSSES[1])), start=1):
        mbs, _ = local_micro_batches(make_batch(12, seed), CAP)
        grads = {}
        for name, engine in engines.items():
            engine.forward_backward(mbs, loss, max_response_len=48)
            grads[name] = full_grads(engine)
        norms = {name: engine.optim_step()["actor/grad_norm"] for name, engine in engines.items()}
        weights = {name: {k: v.float().cuda() for k, v in e.export_weights()} for name, e in engines.items()}
        print(f"\nstep {step}: grad norms {norms}")
        print(f"{'parameter':44s} {'grad noise':>11s} {'grad offl':>11s} {'w noise':>11s} {'w offl':>11s} {'|grad|max':>10s}")
        for pname, g in grads["plain"].items():
            hf = pname.replace("_fsdp_wrapped_module.", "")
            wname = next((k for k in weights["plain"] if hf.endswith(k.split("model.", 1)[-1])), None)
            w_noise = w_off = float("nan")
            if wname is not None:
                w_noise = float((weights["again"][wname] - weights["plain"][wname]).abs().max())
                w_off = float((weights["offload"][wname] - weights["plain"][wname]).abs().max())
            g_noise = float((grads["again"][pname] - g).abs().max())
            g_off = float((grads["offload"][pname] - g).abs().max())
            flag = "  <--" if w_off > 4 * w_noise + 2e-6 or g_off > 4 * g_noise + 1e-6 else ""
            print(f"{hf[:44]:44s} {g_noise:11.2e} {g_off:11.2e} {w_noise:11.2e} {w_off:11.2e} {float(g.abs().max()):10.2e}{flag}")


if __name__ == "__main__":
    main()
