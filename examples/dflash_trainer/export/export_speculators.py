"""The speculators (vLLM) form of an exported drafter, written without the `speculators` package.

The layout is what `speculators.convert.dflash.DFlashConverter` (speculators 0.9.0) writes from a
z-lab checkpoint plus the verifier, and what `DFlashDraftModel.from_pretrained` and vLLM read:
`config.json` holding a `DFlashSpeculatorConfig` (`speculators_model_type: "dflash"`, the draft
body as `transformer_layer_config`, `aux_hidden_state_layer_ids`, `block_size`, `mask_token_id`,
`draft_vocab_size`, `speculators_config` naming the verifier) and `model.safetensors` with the
draft body only: for a full-vocabulary draft, speculators rebuilds `embed_tokens` and `lm_head`
from the verifier on load and leaves them out on save. tests/export_reference checks this file's
output against the converter's and loads both with the reference implementation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from .source import ExportError, Source, fresh_dir
from .zlab import zlab_config

SPECULATORS_VERSION = "0.9.0"  # the release whose format this writes
# z-lab-only keys; the rest of the z-lab config is the draft body's Qwen3 config.
_ZLAB_ONLY = ("architectures", "block_size", "dflash_config", "num_target_layers", "rope_theta")


def aux_layer_ids(src: Source) -> list[int]:
    """speculators numbers a feature by its hidden_states index (layer id + 1, the input of the
    next layer, which vLLM captures); the target's last layer has no such slot (speculators keeps
    the final hidden state apart as the verifier's own), so a drafter reading it cannot be
    expressed."""
    ids = [i + 1 for i in src.layer_ids]
    if src.num_target_layers in ids:
        raise ExportError(
            f"--format speculators cannot express this drafter: its target_layer_ids {src.layer_ids} "
            f"include the last layer ({src.num_target_layers - 1}) of the {src.num_target_layers}-layer "
            f"target {src.target_dir}, which speculators reserves for the verifier; use --format zlab, "
            f"or train with a target of at least {len(src.layer_ids) + 3} layers"
        )
    return ids


def speculators_config(src: Source, verifier: str | None = None) -> dict[str, Any]:
    """The config; ``verifier`` (a hub id or path) is what vLLM loads as the target, by default the
    directory the run trained against."""
    layer = {k: v for k, v in zlab_config(src).items() if k not in _ZLAB_ONLY}
    layer["sliding_window"] = None
    speculative_tokens = src.block_size - 1  # sample_from_anchor=False: the anchor is the bonus token
    return {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": src.vocab_size,
        "block_size": src.block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": aux_layer_ids(src),
        "mask_token_id": src.mask_token_id,
        "sliding_window_non_causal": False,  # no sliding-window layers; full layers are non-causal
        "sample_from_anchor": False,
        "tie_word_embeddings": False,
        "dtype": layer["dtype"],
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier or str(src.target_dir),
                         "architectures": list(getattr(src.target_config, "architectures", None) or [])},
        },
    }


def write_speculators(src: Source, out: str | Path, verifier: str | None = None) -> Path:
    config = speculators_config(src, verifier)  # raises before anything is written
    out = fresh_dir(out)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in src.weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out
