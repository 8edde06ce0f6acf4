"""The build of the embedded default assets (see ``assets``, which caches it): what a build makes
(``BuildSpec``, the special tokens, the files it writes) and its steps: a stdlib corpus, a
byte-level BPE tokenizer, a tiny Qwen3 target trained on the corpus, and data the target
regenerates."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Bump when the build recipe changes in a way that makes old caches wrong.
ASSETS_VERSION = "v1"

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
RESERVED_TOKENS = tuple(f"<|reserved_{i}|>" for i in range(6))
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, *RESERVED_TOKENS)

# The files a build writes, relative to its directory (DefaultAssets names their full paths).
TARGET_DIR = "target"
TRAIN_FILE = "train.jsonl"
EVAL_FILE = "eval_prompts.jsonl"
REPORT_FILE = "target_report.json"


@dataclass(frozen=True)
class BuildSpec:
    """Sizes of the default-asset build. The defaults are the real build (assets.BUILD_TIME: minutes,
    following the CPU cores free for it); :meth:`tiny` is a seconds-long build for tests."""

    corpus_max_bytes: int = 3_000_000
    heldout_every: int = 10  # about 1 file in this many goes to the held-out split
    vocab_size: int = 2000  # BPE vocab incl. special tokens; the model rounds up
    hidden_size: int = 128
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    max_position_embeddings: int = 4096
    seq_len: int = 128
    batch_size: int = 16
    train_steps: int = 500
    lr: float = 5e-3
    warmup_steps: int = 25
    eval_windows: int = 64  # held-out windows of seq_len tokens for the loss check
    min_loss_drop: float = 1.5  # nats; less means the target did not learn
    prompt_len: int = 64
    new_tokens: int = 96
    num_samples: int = 512
    num_eval_prompts: int = 16
    gen_batch_size: int = 128
    seed: int = 0

    @classmethod
    def tiny(cls) -> "BuildSpec":
        """A build of a few seconds with the same code paths, for tests."""
        return cls(
            corpus_max_bytes=300_000, heldout_every=5, vocab_size=400, hidden_size=64,
            num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=128,
            max_position_embeddings=512, seq_len=64, batch_size=8, train_steps=60,
            lr=1e-2, warmup_steps=5, eval_windows=16, min_loss_drop=0.5, prompt_len=24,
            new_tokens=16, num_samples=24, num_eval_prompts=4, gen_batch_size=24,
        )

    def validate(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"BuildSpec: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention")
        if self.vocab_size <= 256 + len(SPECIAL_TOKENS):
            raise ValueError(
                f"BuildSpec: vocab_size {self.vocab_size} leaves no room for merges; a "
                f"byte-level BPE needs 256 byte tokens + {len(SPECIAL_TOKENS)} special tokens")
        if self.prompt_len + self.new_tokens > self.max_position_embeddings:
            raise ValueError(
                "BuildSpec: prompt_len + new_tokens exceeds max_position_embeddings; "
                "raise max_position_embeddings")
        for name in ("head_dim", "train_steps", "batch_size", "seq_len", "num_samples",
                     "num_eval_prompts", "gen_batch_size", "eval_windows", "heldout_every",
                     "prompt_len", "new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"BuildSpec: {name} must be >= 1, got {getattr(self, name)}")

    def fingerprint(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:10]


# Directories of the stdlib that are not ordinary library code: installed third-party
# packages (differ per machine), test suites (huge, repetitive), generated tables.
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
     "encodings", "pydoc_data"}
)
_MAX_FILE_BYTES = 200_000  # skip a few giant files so no single file dominates the corpus


def build(out: Path, spec: BuildSpec) -> dict:
    """Build every default asset into the empty directory ``out``; returns the report it writes."""
    import transformers
    import tokenizers

    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    logger.info("default assets: building into %s (spec %s)", out, spec.fingerprint())

    t = time.perf_counter()
    corpus = _select_corpus(spec)
    timings["corpus_s"] = time.perf_counter() - t

    t = time.perf_counter()
    tokenizer = _train_tokenizer(corpus["train"], spec)
    tokenizer.save_pretrained(out / TARGET_DIR)
    train_files = [ids for ids in _encode(tokenizer, corpus["train"]) if ids]
    heldout_files = [ids for ids in _encode(tokenizer, corpus["heldout"]) if ids]
    timings["tokenizer_s"] = time.perf_counter() - t
    logger.info("default assets: tokenizer of %d tokens trained in %.1fs", len(tokenizer),
                timings["tokenizer_s"])

    t = time.perf_counter()
    model, losses = _train_target(tokenizer, train_files, heldout_files, spec)
    model.save_pretrained(out / TARGET_DIR, safe_serialization=True)
    timings["target_train_s"] = time.perf_counter() - t

    t = time.perf_counter()
    data = _generate_data(model, tokenizer, train_files, heldout_files, spec, out)
    timings["generate_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t_start

    n_params = sum(p.numel() for p in model.parameters())
    report = {
        "assets_version": ASSETS_VERSION,
        "spec": dataclasses.asdict(spec),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
        "corpus": {k: v for k, v in corpus.items() if k not in ("train", "heldout")},
        "tokens": {"train": sum(map(len, train_files)), "heldout": sum(map(len, heldout_files))},
        "tokenizer_vocab": len(tokenizer),
        "model_vocab": model.config.vocab_size,
        # First embedding row that no token uses: a mask token that needs no resize.
        "mask_token_id": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "num_parameters": n_params,
        "heldout_loss_before": losses["before"],
        "heldout_loss_after": losses["after"],
        "train_loss_last": losses["train_last"],
        "data": data,
        "timings": timings,
        "bytes": {p.name: p.stat().st_size for p in sorted((out / TARGET_DIR).iterdir())}
        | {TRAIN_FILE: (out / TRAIN_FILE).stat().st_size, EVAL_FILE: (out / EVAL_FILE).stat().st_size},
    }
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    logger.info(
        "default assets: built in %.1fs (corpus %.1fs, tokenizer %.1fs, target %.1fs, "
        "data %.1fs); held-out loss %.3f -> %.3f", timings["total_s"], timings["corpus_s"],
        timings["tokenizer_s"], timings["target_train_s"], timings["generate_s"],
        losses["before"], losses["after"])
    return report


def _select_corpus(spec: BuildSpec) -> dict:
    """Deterministic stdlib selection: files ordered by a hash of their relative path
    (a spread over packages, unlike alphabetical order) and taken until the byte cap."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    candidates = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        # Prune in place so os.walk never descends into site-packages (can be huge).
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for fname in filenames:
            path = Path(dirpath, fname)
            if not fname.endswith(".py"):
                continue
            try:
                if path.stat().st_size > _MAX_FILE_BYTES:
                    continue
            except OSError:
                continue
            rel = path.relative_to(stdlib)
            candidates.append((hashlib.sha256(rel.as_posix().encode()).hexdigest(), rel))
    candidates.sort()  # hash order is deterministic whatever order os.walk lists files in

    train: list[str] = []
    heldout: list[str] = []
    total = 0
    for digest, rel in candidates:
        try:
            text = (stdlib / rel).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if total + len(text) > spec.corpus_max_bytes:
            continue  # a smaller file later may still fit
        total += len(text)
        (heldout if int(digest, 16) % spec.heldout_every == 0 else train).append(text)
    if not train or not heldout:
        raise RuntimeError(
            f"default assets: the stdlib at {stdlib} gave {len(train)} train and "
            f"{len(heldout)} held-out files; need both. Raise BuildSpec.corpus_max_bytes "
            "or lower heldout_every")
    logger.info("default assets: corpus of %d train + %d held-out stdlib files (%.2f MB)",
                len(train), len(heldout), total / 1e6)
    return {"train": train, "heldout": heldout, "stdlib": str(stdlib),
            "train_files": len(train), "heldout_files": len(heldout), "chars": total}


def _train_tokenizer(texts: list[str], spec: BuildSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        additional_special_tokens=list(RESERVED_TOKENS),
        model_max_length=spec.max_position_embeddings)


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _stream(files: list[list[int]], eos: int) -> torch.Tensor:
    """All files concatenated, each followed by EOS (document separator)."""
    return torch.tensor([t for ids in files for t in (*ids, eos)], dtype=torch.long)


def _heldout_loss(model, windows: torch.Tensor, batch_size: int) -> float:
    model.eval()
    total = 0.0
    with torch.no_grad():
        for chunk in windows.split(batch_size):
            total += model(input_ids=chunk, labels=chunk).loss.item() * len(chunk)
    model.train()
    return total / len(windows)


def _train_target(tokenizer, train_files, heldout_files, spec: BuildSpec):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    eos = tokenizer.eos_token_id
    train = _stream(train_files, eos)
    heldout = _stream(heldout_files, eos)
    L = spec.seq_len
    n_eval = min(spec.eval_windows, len(heldout) // L)
    if n_eval < 1 or len(train) <= L + 1:
        raise RuntimeError(
            f"default assets: {len(train)} train / {len(heldout)} held-out tokens are too few "
            f"for seq_len {L}; raise BuildSpec.corpus_max_bytes or lower seq_len")
    eval_windows = heldout[: n_eval * L].view(n_eval, L)

    # Round up (strictly) to a multiple of 64 so unused embedding rows exist: DFlash's
    # mask token must be an existing row no real token uses.
    vocab = (len(tokenizer) // 64 + 1) * 64
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=False,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)

    # fork_rng: seed the model init without touching the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = eos
    gen = torch.Generator().manual_seed(spec.seed)

    before = _heldout_loss(model, eval_windows, spec.batch_size)
    logger.info("default assets: target of %.2fM parameters, held-out loss before %.3f",
                sum(p.numel() for p in model.parameters()) / 1e6, before)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)
    offsets = torch.arange(L)
    log_every = max(1, spec.train_steps // 10)
    t0 = time.perf_counter()
    model.train()
    for step in range(spec.train_steps):
        # Linear warmup, cosine decay to 10% of the peak.
        warm = min(1.0, (step + 1) / max(1, spec.warmup_steps))
        cos = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / spec.train_steps))
        for group in opt.param_groups:
            group["lr"] = spec.lr * warm * cos
        starts = torch.randint(0, len(train) - L, (spec.batch_size,), generator=gen)
        batch = train[starts[:, None] + offsets]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % log_every == 0 or step + 1 == spec.train_steps:
            logger.info("default assets: target step %d/%d loss %.3f (%.1fs)", step + 1,
                        spec.train_steps, loss.item(), time.perf_counter() - t0)
    after = _heldout_loss(model, eval_windows, spec.batch_size)
    model.eval()
    logger.info("default assets: held-out loss %.3f -> %.3f", before, after)
    if not before - after >= spec.min_loss_drop:
        raise RuntimeError(
            f"default assets: the target did not learn: held-out loss {before:.3f} -> "
            f"{after:.3f}, a drop below the required {spec.min_loss_drop} nats. Data "
            "regenerated by such a target would be noise; check the training loop or give "
            "BuildSpec more train_steps / a better lr")
    return model, {"before": before, "after": after, "train_last": loss.item()}


def _sample_prompts(files: list[list[int]], n: int, length: int,
                    gen: torch.Generator) -> torch.Tensor:
    """``n`` windows of ``length`` tokens, uniform over start positions, never crossing
    a file boundary (a prompt is one file's code, as a user's prompt would be)."""
    usable = [torch.tensor(ids) for ids in files if len(ids) >= length]
    if not usable:
        raise RuntimeError(f"default assets: no file has {length} tokens for a prompt; "
                           "lower BuildSpec.prompt_len")
    counts = torch.tensor([len(ids) - length + 1 for ids in usable])
    cum = counts.cumsum(0)
    picks = torch.randint(0, int(cum[-1]), (n,), generator=gen)
    which = torch.searchsorted(cum, picks, right=True)
    prompts = []
    for f, p in zip(which.tolist(), picks.tolist()):
        start = p - (int(cum[f - 1]) if f else 0)
        prompts.append(usable[f][start:start + length])
    return torch.stack(prompts)


def _generate_data(model, tokenizer, train_files, heldout_files, spec: BuildSpec,
                   out: Path) -> dict:
    gen = torch.Generator().manual_seed(spec.seed + 1)
    eos = tokenizer.eos_token_id
    prompts = _sample_prompts(train_files, spec.num_samples, spec.prompt_len, gen)
    response_lens = []
    ended_with_eos = 0
    t0 = time.perf_counter()
    with open(out / TRAIN_FILE, "w") as fh, torch.no_grad():
        for i, chunk in enumerate(prompts.split(spec.gen_batch_size)):
            # All prompts have the same length, so no padding and no attention mask games.
            seqs = model.generate(input_ids=chunk, attention_mask=torch.ones_like(chunk),
                                  max_new_tokens=spec.new_tokens, do_sample=False,
                                  eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
            for prompt, seq in zip(chunk.tolist(), seqs[:, chunk.shape[1]:].tolist()):
                # Keep the response up to and including the first EOS; after it `generate`
                # pads, and padding is not something the target said.
                response = seq[: seq.index(eos) + 1] if eos in seq else seq
                response_lens.append(len(response))
                ended_with_eos += response[-1] == eos
                fh.write(json.dumps({"input_ids": prompt + response,
                                     "loss_mask": [0] * len(prompt) + [1] * len(response)},
                                    separators=(",", ":")) + "\n")
            logger.info("default assets: generated %d/%d responses (%.1fs)",
                        min((i + 1) * spec.gen_batch_size, spec.num_samples), spec.num_samples,
                        time.perf_counter() - t0)

    eval_prompts = _sample_prompts(heldout_files, spec.num_eval_prompts, spec.prompt_len, gen)
    with open(out / EVAL_FILE, "w") as fh:
        for prompt in eval_prompts.tolist():
            fh.write(json.dumps({"input_ids": prompt}, separators=(",", ":")) + "\n")
    return {"num_samples": len(response_lens), "num_eval_prompts": len(eval_prompts),
            "prompt_len": spec.prompt_len,
            "mean_response_len": sum(response_lens) / len(response_lens),
            "ended_with_eos": ended_with_eos}
