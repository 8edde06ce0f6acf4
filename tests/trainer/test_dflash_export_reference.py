"""The exported drafter, loaded by the reference implementation (speculators 0.9.0's
DFlashDraftModel), gives the project drafter's logits for the same features, ids and anchors.

Needs `speculators`, whose pins (transformers <= 5.19, torchvision, torchaudio) do not fit the
project's environment; `bash tests/export_reference/run.sh` builds a venv for it and runs this
file. Without speculators every test here skips.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("speculators", reason="needs speculators 0.9.0: run bash tests/export_reference/run.sh")

from tests.helpers.export_fixtures import make_checkpoint, make_random_target  # noqa: E402

from examples.dflash_trainer.export.export import export  # noqa: E402
from examples.dflash_trainer.drafter.loss import block_positions, build_blocks, dflash_attention_mask  # noqa: E402
from examples.dflash_trainer.target import TargetModel  # noqa: E402

SEQ = 40
ANCHORS = torch.tensor([0, 3, 11, 12, 20, 31])  # < SEQ - block_size (speculators' anchor rule)


@pytest.fixture(params=["random-qwen3", "embedded-default"])
def case(request, tmp_path):
    """(checkpoint, target_dir, drafter) for a random Qwen3-shaped target or the embedded default."""
    if request.param == "random-qwen3":
        target_dir = make_random_target(tmp_path / "target")
        ckpt, drafter = make_checkpoint(tmp_path / "run" / "checkpoints", target_dir, saved_target=str(target_dir),
                                        num_layers=2, n=3, block_size=8)
    else:
        from examples.dflash_trainer.assets.assets import default_assets

        target_dir = Path(default_assets().target_dir)
        # saved_target=None: what a run on the embedded default records; export finds it itself.
        ckpt, drafter = make_checkpoint(tmp_path / "run" / "checkpoints", target_dir, saved_target=None,
                                        num_layers=2, n=2, block_size=8)
    return request.param, tmp_path / "run", target_dir, drafter


def _inputs(target_dir: Path, n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    target = TargetModel.from_pretrained(target_dir, num_feature_layers=n, dtype=torch.float32)
    ids = torch.randint(0, len(target.tokenizer), (1, SEQ), generator=gen)
    with torch.no_grad():
        out = target.model.model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return target, ids, out.hidden_states


def _project_logits(drafter, ids, features, mask_token_id, block_size):
    anchors = ANCHORS[None]
    keep = torch.ones_like(anchors, dtype=torch.bool)
    with torch.no_grad():
        return drafter(build_blocks(ids, anchors, mask_token_id, block_size), features,
                       block_positions(anchors, block_size), torch.arange(SEQ)[None],
                       dflash_attention_mask(anchors, keep, SEQ, block_size))


def _reference_logits(spec_dir: Path, ids, hidden_states, monkeypatch):
    """DFlashDraftModel's own training forward (mask, RoPE positions, block building), with its
    anchor draw replaced by ours; features are chosen by its own aux_hidden_state_layer_ids."""
    import speculators.models.dflash.core as core
    from speculators.models.dflash import DFlashDraftModel

    model = DFlashDraftModel.from_pretrained(str(spec_dir)).eval()
    aux = model.config.aux_hidden_state_layer_ids
    features = torch.cat([hidden_states[i] for i in aux], dim=-1)
    n = len(ANCHORS)
    monkeypatch.setattr(core, "select_anchors", lambda loss_mask, k, bs: (ANCHORS.clone(), torch.ones(n, dtype=torch.bool)))
    with torch.no_grad():
        _, logits, _, _, _ = model._backbone_forward(
            features, ids, torch.ones_like(ids), torch.zeros(1, SEQ, hidden_states[0].shape[-1]),
            torch.zeros_like(ids), max_anchors=n)
    return logits, features, model


def test_zlab_export_through_the_converter_matches_the_reference(case, tmp_path, monkeypatch):
    from speculators.convert.dflash import DFlashConverter

    name, run, target_dir, drafter = case
    zlab, _ = export(run, "zlab", tmp_path / "zlab")
    DFlashConverter().convert(str(zlab), str(tmp_path / "spec"), base_model=str(target_dir))
    cfg = json.loads((zlab / "config.json").read_text())
    target, ids, hidden = _inputs(target_dir, len(cfg["dflash_config"]["target_layer_ids"]))
    assert cfg["dflash_config"]["target_layer_ids"] == target.layer_ids
    assert cfg["dflash_config"]["mask_token_id"] == target.mask_token_id
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == len(target.model.model.layers)
    ref, ref_features, model = _reference_logits(tmp_path / "spec", ids, hidden, monkeypatch)
    # the reference picks the same target layers as the trainer
    assert torch.equal(ref_features, target.features(ids))
    assert model.mask_token_id == target.mask_token_id and model.block_size == 8
    mine = _project_logits(drafter, ids, ref_features, target.mask_token_id, 8)
    diff = (mine - ref).abs().max().item()
    print(f"\n[{name}] zlab->DFlashConverter->DFlashDraftModel max |logit diff| = {diff:.3e} "
          f"(logit scale {ref.abs().max().item():.2f})")
    torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-4)  # fp32 rounding at logits ~30
    # The comparison can fail: SpecForge's old context mask (kv <= anchor) is far off.
    # (the block part of the mask does not depend on the anchors, the context part becomes kv < a+1)
    leaky = dflash_attention_mask(ANCHORS[None] + 1, torch.ones(1, len(ANCHORS), dtype=torch.bool), SEQ, 8)
    with torch.no_grad():
        wrong = drafter(build_blocks(ids, ANCHORS[None], target.mask_token_id, 8), ref_features,
                        block_positions(ANCHORS[None], 8), torch.arange(SEQ)[None], leaky)
    assert (wrong - ref).abs().max().item() > 1e-2


def test_speculators_export_loads_like_the_converted_one(case, tmp_path, monkeypatch):
    from speculators.convert.dflash import DFlashConverter

    name, run, target_dir, drafter = case
    spec, _ = export(run, "speculators", tmp_path / "spec_direct")
    zlab, _ = export(run, "zlab", tmp_path / "zlab")
    DFlashConverter().convert(str(zlab), str(tmp_path / "spec_conv"), base_model=str(target_dir))
    direct = json.loads((spec / "config.json").read_text())
    converted = json.loads((tmp_path / "spec_conv" / "config.json").read_text())
    for key in ("aux_hidden_state_layer_ids", "block_size", "mask_token_id", "draft_vocab_size",
                "sample_from_anchor", "speculators_config", "speculators_model_type"):
        assert direct[key] == converted[key], key
    layer_keys = set(converted["transformer_layer_config"]) - {"initializer_range", "max_window_layers", "use_cache"}
    for key in layer_keys:
        assert direct["transformer_layer_config"].get(key) == converted["transformer_layer_config"][key], key
    _, ids, hidden = _inputs(target_dir, 1)
    ref, features, _ = _reference_logits(spec, ids, hidden, monkeypatch)
    conv, _, _ = _reference_logits(tmp_path / "spec_conv", ids, hidden, monkeypatch)
    mask = direct["mask_token_id"]
    mine = _project_logits(drafter, ids, features, mask, 8)
    diff = (mine - ref).abs().max().item()
    print(f"\n[{name}] speculators export->DFlashDraftModel max |logit diff| = {diff:.3e}")
    torch.testing.assert_close(ref, conv, rtol=0, atol=0)
    torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-4)  # fp32 rounding at logits ~30
