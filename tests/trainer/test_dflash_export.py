"""CPU tests of the DFlash export (examples/dflash_trainer/export/): the round trip through the
z-lab format continues training with the same losses, the configs record the run's facts, and
every refusal says what is wrong and what to do. The comparison against the reference
implementation is tests/trainer/test_dflash_export_reference.py (own venv)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.export_fixtures import load_heads, make_checkpoint, make_random_target
from tests.helpers import tiny_run

from examples.dflash_trainer.run.checkpoint import WEIGHTS
from examples.dflash_trainer.export.export import export, main
from examples.dflash_trainer.export.source import ExportError
from examples.dflash_trainer.export.zlab import load_zlab_drafter
from examples.dflash_trainer.train import train


@pytest.fixture(scope="module")
def random_run(tmp_path_factory):
    """A checkpoint of a drafter for an 8-layer random Qwen3 target: (run dir, target, drafter)."""
    root = tmp_path_factory.mktemp("random")
    target = make_random_target(root / "target")
    _, drafter = make_checkpoint(root / "run" / "checkpoints", target, saved_target=str(target), n=3)
    return root / "run", target, drafter


def tiny_config(assets, out_dir, **overrides):
    return tiny_run.tiny_config(assets, out_dir, **{"max_steps": 10, **overrides})


def test_export_load_back_and_continue_training_gives_the_same_losses(tiny_assets, tmp_path):
    full = train(tiny_config(tiny_assets, tmp_path / "full")).losses
    split = tmp_path / "split"
    train(tiny_config(tiny_assets, split, checkpoint_every=4))
    (split / "checkpoints" / "latest").write_text("step_00000004\n")  # as if killed after step 4
    out, warnings = export(split, "zlab", tmp_path / "zlab")
    assert len(warnings) == 1 and "include the target's last layer (1)" in warnings[0]  # tiny target: 2 layers
    # Replace the checkpoint's weights by the exported drafter, loaded back into the project's.
    step_dir = split / "checkpoints" / "step_00000004"
    original = load_file(str(step_dir / WEIGHTS))
    target = load_heads(tiny_assets.target_dir)
    drafter = load_zlab_drafter(out, target.embed_tokens, target.lm_head)
    (step_dir / WEIGHTS).unlink()
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, str(step_dir / WEIGHTS),
              metadata={"step": "4", "arch": json.dumps(drafter.arch)})
    assert set(load_file(str(step_dir / WEIGHTS))) == set(original)
    # The checkpoint's manifest vouches for its files: record the replaced weights there, as a
    # re-save would (safetensors' bytes for the same tensors can differ between releases).
    manifest = json.loads((step_dir / "manifest.json").read_text())
    data = (step_dir / WEIGHTS).read_bytes()
    manifest["files"][WEIGHTS] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step_dir / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    resumed = train(tiny_config(tiny_assets, split, checkpoint_every=4, resume=True))
    assert resumed.start_step == 4
    print(f"\nround trip: uninterrupted steps 5-10 {full[4:]}\n            exported+reloaded   {resumed.losses}")
    assert resumed.losses == full[4:]


def test_the_zlab_config_records_the_target_layers_block_size_and_mask_token(random_run, tmp_path):
    run, target, drafter = random_run
    out, warnings = export(run, "zlab", tmp_path / "zlab")
    cfg = json.loads((out / "config.json").read_text())
    assert warnings == []
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 8
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3, 5]  # round(1 + i*(8-4)/2)
    assert cfg["dflash_config"]["mask_token_id"] == 120  # first row past the 120-token tokenizer
    assert cfg["vocab_size"] == 160 and cfg["num_hidden_layers"] == 2 and cfg["head_dim"] == 16
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}
    assert cfg["layer_types"] == ["full_attention"] * 2
    weights = load_file(str(out / "model.safetensors"))
    for name, value in drafter.state_dict().items():
        assert torch.equal(weights[name], value), name
    assert sorted({k.split(".")[0] for k in weights}) == ["fc", "hidden_norm", "layers", "norm"]


def test_bfloat16_export_halves_the_weights_and_says_so(random_run, tmp_path):
    run, _, drafter = random_run
    out, _ = export(run, "zlab", tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    weights = load_file(str(out / "model.safetensors"))
    assert torch.equal(weights["fc.weight"], drafter.fc.weight.detach().bfloat16())
    with pytest.raises(ExportError, match=r"--dtype 'int8'.*float32"):
        export(run, "zlab", tmp_path / "int8", dtype="int8")


def test_the_speculators_config_numbers_features_by_hidden_state_index(random_run, tmp_path):
    run, target, _ = random_run
    out, _ = export(run, "speculators", tmp_path / "spec")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["aux_hidden_state_layer_ids"] == [2, 4, 6]
    assert cfg["mask_token_id"] == 120 and cfg["block_size"] == 8 and cfg["sample_from_anchor"] is False
    assert cfg["draft_vocab_size"] == 160 == cfg["transformer_layer_config"]["vocab_size"]
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 7
    assert cfg["speculators_config"]["verifier"] == {"name_or_path": str(target),
                                                     "architectures": ["Qwen3ForCausalLM"]}


def test_a_target_with_rope_scaling_exports_the_plain_rope_the_drafter_uses(tmp_path):
    target = make_random_target(tmp_path / "target", layers=6)
    cfg_file = target / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
    cfg_file.write_text(json.dumps(cfg))
    make_checkpoint(tmp_path / "run", target, saved_target=str(target), n=2)
    out, _ = export(tmp_path / "run", "zlab", tmp_path / "zlab")
    assert json.loads((out / "config.json").read_text())["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}


def test_speculators_refuses_a_feature_from_the_targets_last_layer(tiny_assets, tmp_path):
    make_checkpoint(tmp_path / "run", tiny_assets.target_dir, saved_target=str(tiny_assets.target_dir),
                    num_layers=1, n=1)
    with pytest.raises(ExportError, match=r"--format speculators cannot express this drafter: its "
                                          r"target_layer_ids \[1\] include the last layer \(1\).*use --format zlab"):
        export(tmp_path / "run", "speculators", tmp_path / "spec")
    assert not (tmp_path / "spec").exists()  # nothing half-written


def test_a_target_moved_away_needs_target_flag(random_run, tmp_path, capsys):
    run, target, _ = random_run
    moved = tmp_path / "elsewhere"
    shutil.copytree(run, tmp_path / "run")
    shutil.copytree(target, moved)
    cfg_state = tmp_path / "run"
    # the saved config names `target`; pretend this machine does not have it
    real = target.rename(target.with_name("hidden"))
    try:
        assert main(["--checkpoint", str(cfg_state), "--format", "zlab", "--out", str(tmp_path / "a")]) == 2
        err = capsys.readouterr().err
        assert str(target) in err and "--target" in err, err
        assert main(["--checkpoint", str(cfg_state), "--format", "zlab", "--out", str(tmp_path / "b"),
                     "--target", str(moved)]) == 0
        assert "wrote zlab drafter to" in capsys.readouterr().out
    finally:
        real.rename(target)


def test_a_target_of_another_width_is_refused(random_run, tmp_path):
    run, _, _ = random_run
    other = make_random_target(tmp_path / "wide", hidden=96)
    with pytest.raises(ExportError, match=r"hidden_size=96.* 64.*--target"):
        export(run, "zlab", tmp_path / "out", target=other)


def test_bad_paths_get_one_clear_error(random_run, tmp_path):
    run, _, _ = random_run
    with pytest.raises(ExportError, match=r"--checkpoint .*nowhere"):
        export(tmp_path / "nowhere", "zlab", tmp_path / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ExportError, match=r"--out .*full"):
        export(run, "zlab", tmp_path / "full")
    with pytest.raises(ExportError, match=r"--format 'gguf' is not one of \['zlab', 'speculators'\]"):
        export(run, "gguf", tmp_path / "out")
    with pytest.raises(ExportError, match=r"config.json is not a z-lab DFlash config"):
        target = make_random_target(tmp_path / "t2", layers=4)
        load_zlab_drafter(target, None, None)


def test_the_module_entry_point_exports(random_run, tmp_path):
    import subprocess
    import sys

    run, _, _ = random_run
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "examples.dflash_trainer.export", "--checkpoint",
                           str(run / "checkpoints" / "step_00000007"), "--format", "speculators",
                           "--out", str(tmp_path / "spec")], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote speculators drafter to {tmp_path / 'spec'}" in proc.stdout
    assert {p.name for p in (tmp_path / "spec").iterdir()} == {"config.json", "model.safetensors"}


def _corrupt_copy(run, tmp_path, how):
    """A copy of the random run's checkpoint damaged in one way; returns its step directory."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    step = copy / "checkpoints" / "step_00000007"
    if how == "sha":
        manifest = json.loads((step / "manifest.json").read_text())
        manifest["files"][WEIGHTS]["sha256"] = "0" * 64
        (step / "manifest.json").write_text(json.dumps(manifest))
    elif how == "manifest":
        (step / "manifest.json").write_text("{not json")
    elif how == "bitflip":
        data = bytearray((step / WEIGHTS).read_bytes())
        data[-5] ^= 0xFF
        (step / WEIGHTS).write_bytes(bytes(data))
    elif how == "truncated":
        data = (step / WEIGHTS).read_bytes()
        (step / WEIGHTS).write_bytes(data[: len(data) // 2])
    return step


@pytest.mark.parametrize("how, says", [
    ("sha", r"SHA-256 differs from the one in .*manifest.json"),
    ("manifest", r"manifest.json is corrupt"),
    ("bitflip", r"SHA-256 differs from the one in .*manifest.json"),
    ("truncated", r"model.safetensors is corrupt: \d+ bytes"),
])
def test_the_exporter_refuses_what_resume_refuses_with_one_line_and_exit_2(random_run, tmp_path, capsys, how, says):
    run, _, _ = random_run
    step = _corrupt_copy(run, tmp_path, how)
    assert main(["--checkpoint", str(step), "--format", "zlab", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: checkpoint"), err
    assert re.search(says, err[0]), err
    assert not (tmp_path / "out").exists()


def test_the_exporter_refuses_non_finite_weights_even_with_a_matching_manifest(random_run, tmp_path, capsys):
    from examples.dflash_trainer.run.checkpoint import save_checkpoint, read_state

    run, _, drafter = random_run
    step = run / "checkpoints" / "step_00000007"
    with torch.no_grad():
        broken = {k: v.clone() for k, v in drafter.state_dict().items()}
        name = next(k for k, v in broken.items() if v.is_floating_point())
        broken[name].view(-1)[0] = float("inf")
    state = read_state(step)
    root = tmp_path / "ckpt"
    # A checkpoint written properly (its manifest matches) of weights that diverged.
    with torch.no_grad():
        original = {k: v.clone() for k, v in drafter.state_dict().items()}
        drafter.load_state_dict(broken)
        try:
            written = save_checkpoint(root, 7, drafter, None, None, state["extra"])
        finally:
            drafter.load_state_dict(original)
    assert main(["--checkpoint", str(written), "--format", "zlab", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert name in err and "non-finite" in err, err


def test_an_out_that_is_a_file_gets_one_line(random_run, tmp_path, capsys):
    run, _, _ = random_run
    (tmp_path / "afile").write_text("x")
    assert main(["--checkpoint", str(run), "--format", "zlab", "--out", str(tmp_path / "afile")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --out {tmp_path / 'afile'} is a file, not a directory; choose a new directory"]


def test_a_target_shape_run_exports_against_its_shape_without_target(random_run, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from examples.dflash_trainer.assets import assets, shapes
    from examples.dflash_trainer.run.checkpoint import read_state, save_checkpoint

    run, target, drafter = random_run
    step = run / "checkpoints" / "step_00000007"
    config = json.loads(read_state(step)["extra"]["config"])
    config.update(target=None, data=None, target_shape="tiny")
    saved = save_checkpoint(tmp_path / "ckpt", 7, drafter, None, None, {"config": json.dumps(config)})
    asked = []
    monkeypatch.setattr(assets, "default_assets", lambda: SimpleNamespace(name="embedded"))
    monkeypatch.setattr(shapes, "shape_target", lambda name, built: (asked.append((name, built.name)),
                                                                     SimpleNamespace(dir=target))[1])
    out, _ = export(saved, "zlab", tmp_path / "out")
    assert asked == [("tiny", "embedded")]
    assert json.loads((out / "config.json").read_text())["num_target_layers"] == 8


def test_verifier_names_the_speculators_verifier_and_the_printed_commands_use_the_runs_block_size(
        random_run, tmp_path, capsys):
    run, target, _ = random_run
    step = make_checkpoint(tmp_path / "ckpt16", target, saved_target=str(target), block_size=16)[0]
    assert main(["--checkpoint", str(step), "--format", "speculators", "--out", str(tmp_path / "spec"),
                 "--verifier", "Qwen/Qwen3-8B"]) == 0
    cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "Qwen/Qwen3-8B"
    assert f"vllm serve {tmp_path / 'spec'}" in capsys.readouterr().out
    assert main(["--checkpoint", str(step), "--format", "zlab", "--out", str(tmp_path / "zlab"),
                 "--verifier", "Qwen/Qwen3-8B"]) == 0
    said = capsys.readouterr().out
    assert "block size 16: 15 draft tokens a step" in said
    assert (f'vllm serve Qwen/Qwen3-8B --speculative-config \'{{"method": "dflash", "model": "{tmp_path / "zlab"}", '
            f'"num_speculative_tokens": 15}}\'') in said
    assert (f"python -m sglang.launch_server --model-path Qwen/Qwen3-8B --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {tmp_path / 'zlab'} --speculative-num-draft-tokens 16") in said
    assert main(["--checkpoint", str(run), "--format", "zlab", "--out", str(tmp_path / "plain")]) == 0
    said = capsys.readouterr().out  # without --verifier: the target it trained against, block size 8
    assert f"--model-path {target} " in said and "--speculative-num-draft-tokens 8" in said


def test_export_md_shows_the_commands_the_exporter_prints_for_the_default_block_size():
    from examples.dflash_trainer.config import TrainConfig

    doc = (Path(__file__).resolve().parents[2] / "examples" / "dflash_trainer" / "EXPORT.md").read_text()
    block = TrainConfig().block_size
    said = [int(n) for n in re.findall(r'"num_speculative_tokens": (\d+)', doc)]
    drafts = [int(n) for n in re.findall(r"--speculative-num-draft-tokens (\d+)", doc)]
    assert said == [block - 1] and drafts == [block], (said, drafts)
    for flag in ("--dtype float16", "--dtype bfloat16", "--verifier NAME_OR_PATH"):
        assert flag in doc, flag
    from examples.dflash_trainer.export.export import serving_commands

    printed = serving_commands("zlab", Path("drafter-zlab"), block, "Qwen/Qwen3-8B")
    spec = printed[0].split("--speculative-config ", 1)[1].strip("'")
    assert spec in doc, spec
