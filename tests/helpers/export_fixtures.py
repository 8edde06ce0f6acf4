"""Builders shared by the export tests: a random Qwen3-shaped target and a trainer checkpoint of a
drafter with random weights (norms included, so a misplaced or missing norm changes the logits)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from examples.dflash_trainer.run.checkpoint import save_checkpoint
from examples.dflash_trainer.config import TrainConfig
from examples.dflash_trainer.drafter.model import DFlashDrafter


def make_random_target(out: Path, *, layers: int = 8, hidden: int = 64, heads: int = 4,
                       kv_heads: int = 2, head_dim: int = 16, intermediate: int = 96,
                       vocab: int = 160, words: int = 120, rope_theta: float = 1e6,
                       seed: int = 0) -> Path:
    """A randomly initialised Qwen3ForCausalLM (GQA, head_dim != hidden/heads, untied head) with a
    word-level tokenizer of `words` tokens, so rows `words..vocab-1` are spare (the mask token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                         tie_word_embeddings=False, eos_token_id=1, bos_token_id=0, pad_token_id=2)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # non-trivial norms in the target too
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        model.lm_head.weight.mul_(50.0)  # logits of order 10, as a trained head gives
    model.save_pretrained(out)
    vocab_map = {"<s>": 0, "</s>": 1, "<pad>": 2, **{f"w{i}": i for i in range(3, words)}}
    tok = Tokenizer(models.WordLevel(vocab_map, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(out)
    return out


def load_heads(target_dir: Path):
    """The target in float32 on the CPU; its embed_tokens and lm_head are the drafter's frozen heads."""
    from examples.dflash_trainer.target import TargetModel

    target = TargetModel.from_pretrained(target_dir, num_feature_layers=1, dtype=torch.float32)
    return target


def make_checkpoint(root: Path, target_dir: Path, *, saved_target: str | None, num_layers: int = 2,
                    n: int = 3, block_size: int = 8, seed: int = 1) -> tuple[Path, DFlashDrafter]:
    """A trainer checkpoint (as Run.save writes it) of a random drafter for `target_dir`.

    `saved_target` is what the run config records (None = the embedded default target)."""
    from transformers import AutoConfig

    target = load_heads(target_dir)
    gen = torch.Generator().manual_seed(seed)
    drafter = DFlashDrafter.from_target_config(AutoConfig.from_pretrained(target_dir), target.embed_tokens,
                                               target.lm_head, num_layers=num_layers, n=n, generator=gen)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.mul_(5.0)  # larger weights so attention is far from uniform
    config = TrainConfig(target=saved_target, data=None if saved_target is None else "data.jsonl",
                         block_size=block_size, num_draft_layers=num_layers, num_target_layers_used=n)
    path = save_checkpoint(root, 7, drafter, None, None, {"config": json.dumps(config.to_dict())})
    return path, drafter
