"""The tokenized data, cached: a start whose tokenizer, data file and settings match an earlier one's
loads that start's tensors instead of tokenizing again.

The key is a SHA-256 of everything the tokens depend on: the data file's bytes, the tokenizer (its
serialized vocabulary and merges, special tokens and chat template), ``seq_len``, the vocabulary size,
the pad id, ``reasoning``, and the source of the tokenizing code itself, so a change to any of them
misses the cache instead of loading stale tokens. An entry is written under a temporary name and
renamed, so concurrent starts and crashes never leave a torn one; an unreadable entry is logged and
tokenized again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

import torch

from . import chat, records
from .records import TokenData, read_jsonl

log = logging.getLogger("dflash")

CACHE_DIR = "dflash-data"


def default_cache_dir() -> Path:
    from ..assets.assets import default_cache_root

    return default_cache_root() / CACHE_DIR


def data_cache_dir(config: Any) -> Optional[Path]:
    """The run's cache directory: ``--data-cache``, else the default; None with ``--no-data-cache``."""
    if config.no_data_cache:
        return None
    return Path(config.data_cache) if config.data_cache is not None else default_cache_dir()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """What fixes a tokenizer's output: its serialized model (fast tokenizers) or vocabulary, its
    special tokens and its chat template."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    elif tokenizer is not None:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    for name in ("chat_template", "special_tokens_map", "added_tokens_decoder"):
        digest.update(repr(getattr(tokenizer, name, None)).encode())
    return digest.hexdigest()


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_key(path: Path, *, tokenizer: Any, seq_len: int, vocab_size: Optional[int], pad_id: Optional[int],
              reasoning: str) -> str:
    code = b"".join(Path(module.__file__).read_bytes() for module in (records, chat))
    parts = {"data": _file_digest(path), "tokenizer": tokenizer_fingerprint(tokenizer), "seq_len": seq_len,
             "vocab_size": vocab_size, "pad_id": pad_id, "reasoning": reasoning,
             "code": hashlib.sha256(code).hexdigest()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def read_cached(path: str | Path, *, tokenizer: Any, seq_len: int, vocab_size: Optional[int] = None,
                pad_id: Optional[int] = None, reasoning: str = "train",
                cache_dir: Optional[str | Path] = None) -> TokenData:
    """``data.read_jsonl`` through the cache in ``cache_dir`` (None: no cache)."""
    path = Path(path)
    if cache_dir is None or not path.is_file():  # read_jsonl names what is wrong with a missing file
        return read_jsonl(path, tokenizer=tokenizer, seq_len=seq_len, vocab_size=vocab_size, pad_id=pad_id,
                          reasoning=reasoning)
    began = time.perf_counter()
    key = cache_key(path, tokenizer=tokenizer, seq_len=seq_len, vocab_size=vocab_size, pad_id=pad_id,
                    reasoning=reasoning)
    entry = Path(cache_dir) / f"tokens-{key}.pt"
    if entry.is_file():
        try:
            saved = torch.load(entry, map_location="cpu", weights_only=True)
            data = TokenData(ids=saved["ids"], loss_mask=saved["loss_mask"], skipped=int(saved["skipped"]))
        except Exception as err:  # a damaged entry costs a tokenization, never the run
            log.warning("dflash: the data cache entry %s is unreadable (%s: %s); tokenizing %s again", entry,
                        type(err).__name__, err, path)
        else:
            log.info("dflash: %d samples of %s from the data cache (%s; %d skipped when tokenized) in %.1f s",
                     len(data), path, entry, data.skipped, time.perf_counter() - began)
            return data
    data = read_jsonl(path, tokenizer=tokenizer, seq_len=seq_len, vocab_size=vocab_size, pad_id=pad_id,
                      reasoning=reasoning)
    _store(entry, data)
    return data


def _store(entry: Path, data: TokenData) -> None:
    """Write the cache entry, best effort: a cache that cannot be written is one warning, never the run's end."""
    tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"ids": data.ids, "loss_mask": data.loss_mask, "skipped": data.skipped}, tmp)
        os.replace(tmp, entry)
    # A read-only, missing or full cache disk costs the next start a tokenization, not this run: the path
    # raises OSError, torch.save its own RuntimeError (its writer's "open file failed", "file write failed").
    except (OSError, RuntimeError) as err:
        log.warning("dflash: could not write the data cache entry %s (%s); training goes on, and the next start "
                    "tokenizes again (--data-cache DIR elsewhere, or --no-data-cache)", entry,
                    " ".join(str(err).split()))
        try:
            tmp.unlink(missing_ok=True)  # what a full disk left half-written
        except OSError:
            pass
        return
    log.info("dflash: tokenized data cached in %s", entry)
