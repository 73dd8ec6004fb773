"""verl cell of the benchmark matrix: for now an explained row, never made-up numbers.

verl cannot be installed next to slipstream: verl 0.9.1 pins transformers<5.11 and
tensordict<=0.10 (slipstream runs transformers 5.17 on the GPU machine, 5.24 here) and
imports `ray` at module load. Its remove-padding fast path (use_remove_padding=True) needs
flash-attn, which the GPU machine lacks and cannot carry (the wheels are far over its 64 MiB
carry limit). What a GPU run of this cell needs, in order:

  1. the pinned wheels (verl 0.9.1, transformers<5.11, tensordict<=0.10, ray) carried into a
     SEPARATE site directory and put first on PYTHONPATH only for the verl cell (a
     subprocess), so slipstream's own cells keep their transformers;
  2. verl's FSDP engine on its padded path: actor.use_remove_padding=False with
     attn_implementation="sdpa", the row labelled with exactly that configuration;
  3. the same pre-built batch converted to verl's DataProto (input_ids, attention_mask,
     position_ids, responses, response_mask, old_log_probs, advantages), its
     update_policy timed as actor_train and compute_log_prob as log_probs;
  4. any import-only stand-in (e.g. for a package the timed path never calls) listed in the row.
Until then the cell is "missing" (verl not importable) or "not-available" (importable but the
timed path above is not written yet).
"""

from __future__ import annotations

import dataclasses

from slipstream.bench.matrix import CellSettings, VerlSettings
from slipstream.bench.peers import PEERS, install_command, missing_result, peer_version
from slipstream.bench.workloads import Workload

GPU_RUN_NEEDS = (
    "verl 0.9.1 + transformers<5.11 + tensordict<=0.10 + ray wheels carried into a separate site directory, "
    "run in a subprocess with that directory first on PYTHONPATH; verl's FSDP engine on its padded path "
    "(use_remove_padding=False, attn_implementation=sdpa) because flash-attn is not available on the GPU machine"
)


def verl_configuration(settings: CellSettings, verl: VerlSettings, backend: str) -> dict:
    """The verl configuration the cell is (to be) run with, recorded in its row."""
    return {
        "engine": "megatron" if backend == "megatron" else "fsdp",
        **dataclasses.asdict(verl),
        "dtype": settings.dtype,
        "gradient_checkpointing": settings.recompute != "none",
    }


def run_verl_cell(w: Workload, settings: CellSettings, verl: VerlSettings, backend: str) -> dict:
    """The matrix cell for verl: "missing" or "not-available" with the exact reason; no numbers."""
    config = verl_configuration(settings, verl, backend)
    impl = {"name": "verl", "version": peer_version("verl"), "config": config, "gpu_run_needs": GPU_RUN_NEEDS}
    if verl.use_remove_padding:
        impl["note"] = "use_remove_padding=True needs flash-attn, which the GPU machine does not have"
    if impl["version"] is None:
        result = missing_result(
            "verl",
            f"verl is not installed: {PEERS['verl'].note} A GPU run needs: {GPU_RUN_NEEDS}.",
        )
        return {**result, "impl": impl}
    return {
        "status": "not-available",
        "reason": f"verl {impl['version']} is importable, but the adapter's timed path (DataProto from the pre-built "
        f"batch -> {config['engine']} engine update_policy / compute_log_prob) is not written yet",
        "install": install_command("verl"),
        "impl": impl,
    }
