"""JSONL training data -> fixed-shape (ids, loss_mask) batches, sharded over target threads.

Accepted line formats (one JSON object per line; blank lines are ignored):

- {"input_ids": [int, ...], "loss_mask": [0/1, ...]}: pre-tokenised, used as is.
- {"messages": [{"role": str, "content": str, "reasoning_content": str (optional)}, ...]}: loss on
  the assistant turns only, rendered by the tokenizer's chat template; reasoning (``<think>`` blocks)
  trained on, kept as context or dropped by ``reasoning`` (data_chat); a tokenizer without a template
  renders "role: content\\n" per turn, the loss on the assistant's content, not its "assistant: " prefix.
- {"prompt": str, "response": str}: the same as messages [user: prompt, assistant: response].

Samples are truncated/padded to seq_len (pad id = tokenizer pad, else eos, else 0; loss_mask 0).
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from .chat import REASONING, plain_segments, template_segments
from ..errors import BadInput, json_object
from ..drafter.loss import anchor_scores

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 5.0  # a progress line per this much tokenising: a large file is not silent

_FORMATS = ('{"prompt": str, "response": str}, {"messages": [{"role": str, "content": str}, '
            '...]} or {"input_ids": [int, ...], "loss_mask": [0/1, ...]}')


class DataError(BadInput, ValueError):
    """A bad training record; the message names the file and 1-based line."""


@dataclass
class TokenData:
    ids: torch.Tensor  # [M,S] int32 (halves host memory; batches are widened to long)
    loss_mask: torch.Tensor  # [M,S] bool
    skipped: int  # samples dropped for having fewer than 2 consecutive loss tokens

    def __len__(self) -> int:
        return self.ids.shape[0]


def check_data_file(path: str | Path) -> None:
    """Raise ``DataError`` unless ``path`` is a regular file: checked before anything is built."""
    path = Path(path)
    if not path.is_file():
        problem = ("is a directory" if path.is_dir() else "is not a regular file (a device or a pipe)"
                   if path.exists() else "does not exist")
        raise DataError(f"data file {path} {problem}; pass a JSONL file ({_FORMATS})")


def read_jsonl(path: str | Path, *, tokenizer: Any, seq_len: int, vocab_size: int | None = None,
               pad_id: int | None = None, reasoning: str = "train") -> TokenData:
    """Read a JSONL file; `vocab_size` (embedding rows) defaults to len(tokenizer)."""
    path = Path(path)
    check_data_file(path)
    lines = _count_lines(path)
    logger.info("tokenizing %d lines of %s", lines, path)
    with path.open("rb") as raw:
        return tokenize_lines(_utf8_lines(raw, path), source=str(path), tokenizer=tokenizer, seq_len=seq_len,
                              vocab_size=vocab_size, pad_id=pad_id, total_lines=lines, reasoning=reasoning)


def _utf8_lines(raw: Iterable[bytes], path: Path) -> Iterable[str]:
    """The file's lines decoded one by one, so a bad byte is named by its line and its offset in the file."""
    offset = 0
    for lineno, line in enumerate(raw, start=1):
        try:
            yield line.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"data file {path} is not UTF-8 text (line {lineno}, byte {offset + err.start} of the "
                            f"file: {err.reason}); pass a JSONL file ({_FORMATS})") from None
        offset += len(line)


def _count_lines(path: Path) -> int:
    """Lines of the file, counted in binary blocks (well under a second per GB)."""
    count, last = 0, b"\n"
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


def tokenize_lines(lines: Iterable[str], *, source: str, tokenizer: Any, seq_len: int,
                   vocab_size: int | None = None, pad_id: int | None = None,
                   total_lines: int | None = None, reasoning: str = "train") -> TokenData:
    """Tokenise JSONL lines (from a file or embedded data); `source` names them in errors, and
    `total_lines`, where known, in the progress lines; `reasoning`: see data_chat."""
    if reasoning not in REASONING:
        raise ValueError(f"reasoning must be one of {list(REASONING)}, got {reasoning!r}")
    if vocab_size is None and tokenizer is not None:
        vocab_size = len(tokenizer)
    if pad_id is None:
        pad_id = _default_pad_id(tokenizer)
    ids_rows, mask_rows, total = [], [], 0
    start = time.monotonic()
    next_report = start + PROGRESS_EVERY_S
    of = f" of {total_lines}" if total_lines is not None else ""
    for lineno, text in enumerate(lines, start=1):
        if time.monotonic() >= next_report:  # a clock read costs far less than tokenising a line
            logger.info("tokenizing %s: %d%s lines done (%.0f s)", source, lineno - 1, of, time.monotonic() - start)
            next_report = time.monotonic() + PROGRESS_EVERY_S
        if not text.strip():
            continue
        total += 1
        where = f"{source}:{lineno}"
        ids, mask = _parse_line(text, where, tokenizer, vocab_size, seq_len, reasoning)
        ids, mask = ids[:seq_len], mask[:seq_len]
        if not any(a and b for a, b in zip(mask, mask[1:])):
            continue  # no anchor possible: nothing to learn from this sample
        pad = seq_len - len(ids)
        ids_rows.append(ids + [pad_id] * pad)
        mask_rows.append(mask + [0] * pad)
    if time.monotonic() - start >= PROGRESS_EVERY_S:
        logger.info("tokenized %s: %d samples in %.0f s", source, total, time.monotonic() - start)
    skipped = total - len(ids_rows)
    if ids_rows and skipped > total / 2:  # none usable is refused below
        logger.warning("skipped %d of %d samples in %s: they have fewer than 2 consecutive loss tokens within "
                       "the first seq_len=%d tokens (prompt too long or response empty), so the run trains on "
                       "the remaining %d only; raise --seq-len or shorten the prompts", skipped, total, source,
                       seq_len, len(ids_rows))
    elif skipped:
        logger.info("skipped %d of %d samples in %s: fewer than 2 consecutive loss tokens within "
                    "seq_len=%d", skipped, total, source, seq_len)
    if not total:
        raise DataError(f"{source} holds no samples (it is empty or blank); pass a JSONL file ({_FORMATS})")
    if not ids_rows:
        raise DataError(
            f"{source}: no usable samples ({total} read); each needs at least 2 consecutive loss "
            f"tokens within the first seq_len={seq_len} tokens; add responses or raise seq_len"
        )
    return TokenData(ids=torch.tensor(ids_rows, dtype=torch.int32),
                     loss_mask=torch.tensor(mask_rows, dtype=torch.bool), skipped=skipped)


def _default_pad_id(tokenizer: Any) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def _parse_line(text: str, where: str, tokenizer: Any, vocab_size: int | None, seq_len: int,
                reasoning: str) -> tuple[list[int], list[int]]:
    record = json_object(text, where, DataError, _FORMATS)
    if "input_ids" in record:
        ids, mask = _pretokenized(record, where)
    elif "messages" in record:
        ids, mask = _encode(_messages(record["messages"], where), where, tokenizer, seq_len, reasoning)
    elif "prompt" in record or "response" in record:
        for key in ("prompt", "response"):
            if not isinstance(record.get(key), str):
                raise DataError(f"{where}: {key!r} must be a string; use {_FORMATS}")
        turns = [{"role": "user", "content": record["prompt"]},
                 {"role": "assistant", "content": record["response"]}]
        ids, mask = _encode(turns, where, tokenizer, seq_len, reasoning)
    else:
        raise DataError(f"{where}: unknown record with keys {sorted(record)}; use {_FORMATS}")
    limit = vocab_size if vocab_size is not None else float("inf")
    bad = next((i for i in ids if not 0 <= i < limit), None)
    if bad is not None:
        raise DataError(f"{where}: token id {bad} is outside the target vocabulary "
                        f"[0, {vocab_size}); tokenise with the target's tokenizer")
    return ids, mask


def _pretokenized(record: dict, where: str) -> tuple[list[int], list[int]]:
    ids, mask = record["input_ids"], record.get("loss_mask")
    if not isinstance(ids, list) or not all(_is_int(i) for i in ids):
        raise DataError(f"{where}: 'input_ids' must be a list of integers")
    if not isinstance(mask, list) or not all(isinstance(m, bool) or m in (0, 1) and _is_int(m)
                                             for m in mask):
        raise DataError(f"{where}: 'loss_mask' must be a list of 0/1 next to 'input_ids'")
    if len(ids) != len(mask):
        raise DataError(f"{where}: 'input_ids' has {len(ids)} tokens but 'loss_mask' has "
                        f"{len(mask)}; give one mask value per token")
    return ids, [int(m) for m in mask]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _messages(messages: Any, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of "
                        f'{{"role": str, "content": str}}')
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: messages[{i}] must be an object with string 'role' and "
                            f"'content'")
        if m.get("reasoning_content") is not None and not isinstance(m["reasoning_content"], str):
            raise DataError(f"{where}: messages[{i}].reasoning_content must be a string when given")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: 'messages' has no assistant turn, so nothing to train on; add "
                        f"one or drop the line")
    return messages


def _encode(messages: list[dict], where: str, tokenizer: Any, limit: int,
            reasoning: str) -> tuple[list[int], list[int]]:
    """The record's tokens and loss mask, ``limit`` tokens at most. Only a prefix of each text is
    tokenised: enough characters for the tokens still wanted (no token is longer than the
    vocabulary's longest), so a huge record costs what its first ``limit`` tokens cost."""
    if tokenizer is None:
        raise DataError(f"{where}: text records need the target's tokenizer, and there is none; "
                        f"pre-tokenise to input_ids/loss_mask or use a target with a tokenizer")
    ids: list[int] = []
    mask: list[int] = []
    longest = _longest_token_chars(tokenizer)
    for text, is_loss in _segments(messages, where, tokenizer, reasoning):
        wanted = limit - len(ids)
        if wanted <= 0:
            break
        if text:
            # One token past the wanted ones: a cut inside the last word changes only tokens after them.
            cut = text[: (wanted + 1) * longest]
            piece = tokenizer.encode(cut, add_special_tokens=False)
            if len(cut) < len(text):
                piece = piece[:wanted]
            ids += piece
            mask += [int(is_loss)] * len(piece)
    return ids, mask


_longest: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def _longest_token_chars(tokenizer: Any) -> int:
    """Characters of the vocabulary's longest token (at least 1), once per tokenizer."""
    found = _longest.get(tokenizer)
    if found is None:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        found = _longest[tokenizer] = max((len(token) for token in vocab), default=64) or 1
    return found


def _segments(messages: list[dict], where: str, tokenizer: Any, reasoning: str) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, is_loss) pieces, tokenised piece by piece (data_chat)."""
    if not getattr(tokenizer, "chat_template", None):
        return plain_segments(messages, reasoning)
    try:
        pieces, missing = template_segments(messages, tokenizer, reasoning)
    except Exception as err:  # jinja's errors, and the template's own raise_exception
        raise DataError(f"{where}: the tokenizer's chat template refused the messages ({type(err).__name__}: "
                        f"{err}); fix the record or pre-tokenise it to input_ids/loss_mask") from None
    if missing >= 0:
        raise DataError(f"{where}: assistant messages[{missing}] does not appear verbatim in the chat-template "
                        f"rendering; pre-tokenise to input_ids/loss_mask")
    return pieces


class SampleStream:
    """Endless fixed-shape batches in an epoch-shuffled order, shardable.

    The global order is the concatenation of per-epoch permutations (each seeded by
    (seed, epoch)). Consumer c of P = num_shards * world_size (c = rank * num_shards + shard)
    takes global samples c, c+P, c+2P, ...: consumers never overlap, every sample is used once
    per epoch, and a batch may straddle an epoch boundary so tiny datasets still work.
    ``skip_batches`` starts past that many of this consumer's batches (a resumed run).
    """

    def __init__(self, data: TokenData, batch_size: int, *, seed: int = 0, shard: int = 0,
                 num_shards: int = 1, rank: int = 0, world_size: int = 1, skip_batches: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not (0 <= shard < num_shards and 0 <= rank < world_size):
            raise ValueError(f"need 0 <= shard < num_shards and 0 <= rank < world_size, got "
                             f"shard={shard}/{num_shards}, rank={rank}/{world_size}")
        self.data, self.batch_size, self.seed = data, batch_size, seed
        self.consumers = num_shards * world_size
        consumer = rank * num_shards + shard
        # global index of this consumer's next sample
        self._next = consumer + skip_batches * batch_size * self.consumers
        self._perm_epoch, self._perm = -1, []

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [B,S] long, loss_mask [B,S] long)."""
        rows = []
        for _ in range(self.batch_size):
            epoch, position = divmod(self._next, len(self.data))
            rows.append(self._permutation(epoch)[position])
            self._next += self.consumers
        index = torch.tensor(rows)
        return self.data.ids[index].long(), self.data.loss_mask[index].long()

    def _permutation(self, epoch: int) -> list[int]:
        # A list: indexing it is plain Python, not a tensor op (each op is a GIL hand-off in threads).
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
            self._perm_epoch, self._perm = epoch, torch.randperm(len(self.data), generator=g).tolist()
        return self._perm


def anchor_seed(seed: int, rank: int, batch_index: int) -> int:
    """The seed of global batch ``batch_index``'s anchor draws in process ``rank``: anchors depend
    on the batch, never on which thread (or which pipeline) processes it."""
    return (seed * 1_000_003 + rank * 10_007 + batch_index) % 2**62


class ShardBatches:
    """Target shard ``shard`` of ``num_shards``: this process's global batches shard, shard + T,
    shard + 2T, ... from ``first`` on and before ``end``, each with its anchor draws.

    Global batch b of a process is always the same samples and the same anchors, so a resumed run
    (``first`` > 0) and the benchmark's sequential loop see what an uninterrupted threaded run sees.
    """

    def __init__(self, data: TokenData, batch_size: int, *, seed: int, shard: int, num_shards: int,
                 rank: int, world_size: int, first: int, end: int) -> None:
        self.seed, self.shard, self.num_shards, self.rank, self.end = seed, shard, num_shards, rank, end
        self._k = max(0, math.ceil((first - shard) / num_shards))  # this shard's batches already consumed
        self.stream = SampleStream(data, batch_size, seed=seed, shard=shard, num_shards=num_shards, rank=rank,
                                   world_size=world_size, skip_batches=self._k)
        self._anchor_rng = torch.Generator()

    @property
    def index(self) -> int:
        """The global index of the next batch."""
        return self._k * self.num_shards + self.shard

    @property
    def done(self) -> bool:
        return self.index >= self.end

    def next(self) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(b, ids [B,S], loss_mask [B,S], anchor scores [B,S]) on the host, for the next batch b."""
        b = self.index
        ids, loss_mask = self.stream.next_batch()
        self._anchor_rng.manual_seed(anchor_seed(self.seed, self.rank, b))
        scores = anchor_scores(loss_mask, self._anchor_rng)
        self._k += 1
        return b, ids, loss_mask, scores
