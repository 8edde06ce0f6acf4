"""The trainer tests' tiny run: its settings, as a TrainConfig and as the command line that gives
the same config, on the assets conftest.py's ``tiny_assets`` builds once per session; and the tiny
random Qwen3 target the model-level tests share."""

import os

from examples.dflash_trainer.config import TrainConfig

TINY = dict(devices="cpu", seq_len=64, block_size=8, num_anchors=4, batch_size=2, num_draft_layers=1,
            num_target_layers_used=1, max_steps=12, eval_every=0, checkpoint_every=0, lr=3e-3)


def _data_cache(out_dir) -> str:
    """The tokenized-data cache of a test run: beside its --out-dir, never the user's cache."""
    return os.path.join(os.path.dirname(os.path.abspath(out_dir)), "data-cache")


def tiny_config(assets, out_dir, **overrides) -> TrainConfig:
    values = dict(TINY, target=str(assets.target_dir), data=str(assets.train_jsonl), out_dir=str(out_dir),
                  data_cache=_data_cache(out_dir))
    values.update(overrides)
    return TrainConfig(**values)


def tiny_cli(assets, out_dir, *extra, target=None) -> list[str]:
    """The command-line flags of ``tiny_config(assets, out_dir)`` (every flag is a field's name),
    then ``extra``, which overrides them (argparse keeps a repeated flag's last value)."""
    values = dict(TINY, target=str(target or assets.target_dir), data=str(assets.train_jsonl), out_dir=str(out_dir),
                  data_cache=_data_cache(out_dir))
    flags = [part for name, value in values.items() for part in ("--" + name.replace("_", "-"), str(value))]
    return [*flags, *extra]


def tiny_target(vocab_size: int, mask_token_id: int):
    """A 6-layer random Qwen3 (seeded) wrapped as the trainer's target, two feature layers."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from examples.dflash_trainer.target import TargetModel

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128)
    return TargetModel(Qwen3ForCausalLM(cfg), num_feature_layers=2, mask_token_id=mask_token_id)
