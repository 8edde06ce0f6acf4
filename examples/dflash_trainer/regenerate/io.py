"""The files of ``python -m examples.dflash_trainer.regenerate``: the prompt file it reads, and the
output it appends to record by record, so a killed run continues where it stopped.

Prompt lines (JSONL, blank lines ignored; a record's index counts the non-blank lines before it):

- {"prompt": str, ...}: one user turn; any "response" is replaced by the target's.
- {"messages": [{"role": str, "content": str}, ...]}: the conversation up to the turn to generate; a
  last assistant turn is replaced by the target's.

Output lines: {"index": i, "prompt": str, "response": str, "tokens": n} or {"index": i, "messages":
[..., {"role": "assistant", "content": str}], "tokens": n}: the trainer's own record formats, with
``"truncated": true`` where ``--max-new-tokens`` (or the target's positions) cut the response before
its end of turn. Records are written in prompt-index order whichever thread or batch finished first,
so two runs of the same prompts write the same file. Each is written whole, flushed and fsynced
before the next, so a kill leaves at most one torn last line, which the next run cuts off; records
already there (by index) are not generated again. One run at a time writes an output: it holds an
advisory lock on the file while it runs.
"""

from __future__ import annotations

import json
import os
import threading

try:
    import fcntl
except ImportError:  # not POSIX: no lock, the other checks still hold
    fcntl = None
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import BadInput, json_object

RECORD_START = b'{"index": '  # how every output line begins (Prompt.record, json.dumps)
FORMATS = '{"prompt": str} or {"messages": [{"role": str, "content": str}, ...]}'


class PromptError(BadInput, ValueError):
    """A prompt file the regeneration cannot use; the message names the file and line."""


@dataclass(frozen=True)
class Prompt:
    index: int
    messages: tuple  # of {"role", "content"} dicts, ending before the turn to generate
    as_prompt: bool  # written back as {"prompt", "response"} (else as messages)

    def matches(self, record: dict) -> bool:
        """Whether an output record was generated from this prompt."""
        if self.as_prompt:
            return record.get("prompt") == self.messages[-1]["content"]
        return isinstance(record.get("messages"), list) and record["messages"][:-1] == list(self.messages)

    def record(self, text: str, tokens: int, truncated: bool = False) -> dict:
        if self.as_prompt:
            record = {"index": self.index, "prompt": self.messages[-1]["content"], "response": text, "tokens": tokens}
        else:
            record = {"index": self.index, "messages": [*self.messages, {"role": "assistant", "content": text}],
                      "tokens": tokens}
        if truncated:
            record["truncated"] = True
        return record


def read_prompts(path: str | os.PathLike[str]) -> list[Prompt]:
    path = Path(path)
    if not path.is_file():
        problem = "is a directory" if path.is_dir() else "does not exist" if not path.exists() else "is not a file"
        raise PromptError(f"prompt file {path} {problem}; pass a JSONL file of {FORMATS}")
    prompts: list[Prompt] = []
    offset = 0
    with path.open("rb") as raw:
        for lineno, line in enumerate(raw, start=1):
            where = f"{path}:{lineno}"
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise PromptError(f"prompt file {path} is not UTF-8 text (line {lineno}, byte {offset + err.start} "
                                  f"of the file); pass a JSONL file of {FORMATS}") from None
            offset += len(line)
            if lineno == 1:
                text = text.removeprefix("\ufeff")  # a byte order mark some editors write first
            if text.strip():
                prompts.append(_prompt(text, where, len(prompts)))
    if not prompts:
        raise PromptError(f"prompt file {path} holds no prompts (it is empty or blank); pass a JSONL file of {FORMATS}")
    return prompts


def _prompt(text: str, where: str, index: int) -> Prompt:
    record = json_object(text, where, PromptError, FORMATS)
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate escape such as "\ud800": not text a tokenizer or the output takes
        raise PromptError(f"{where}: holds a lone surrogate escape (\\ud800 to \\udfff without its pair), which is not "
                          f"text; fix or drop that line") from None
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise PromptError(f"{where}: 'messages' must be a list of {{\"role\": str, \"content\": str}}")
        turns = [{"role": m["role"], "content": m["content"]} for m in messages]
        if turns and turns[-1]["role"] == "assistant":
            turns.pop()  # the turn to generate again
        if not turns:
            raise PromptError(f"{where}: 'messages' holds no turn before the one to generate; add a user turn")
        return Prompt(index, tuple(turns), as_prompt=False)
    if isinstance(record.get("prompt"), str):
        return Prompt(index, ({"role": "user", "content": record["prompt"]},), as_prompt=True)
    raise PromptError(f"{where}: no 'prompt' string or 'messages' list (keys {sorted(record)}); use {FORMATS}")


class OutputError(BadInput, OSError):
    """An output file this run cannot write, or one another run is writing."""


class Output:
    """The output file: the indices already done (a torn last line cut off first), and the writer
    the request threads share, which puts records into the file in prompt-index order.

    ``put`` takes a finished record; ``skip`` an index that gets no record (a prompt too long for
    the target). Records are held until every index before theirs is written or skipped, so at most
    the records of work in flight wait in memory, and a kill loses only those (the next run
    generates them again)."""

    def __init__(self, path: str | os.PathLike[str], prompts: list[Prompt],
                 data: Optional[str | os.PathLike[str]] = None) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise OutputError(f"--out {self.path} is a directory; pass a .jsonl file path")
        if data is not None and self.path.exists() and os.path.samefile(self.path, data):
            raise OutputError(f"--out {self.path} is the --data prompt file; pass another --out")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "ab")
        except OSError as err:
            raise OutputError(f"--out {self.path} cannot be written ({err.strerror or err}); pass a path in a "
                              f"writable directory") from None
        self._lock_file()
        self.done: set[int] = set()
        try:
            self._resume(prompts)
        except BaseException:
            self._file.close()
            raise
        self._lock = threading.Lock()
        self._count = len(prompts)
        self._waiting: dict[int, Optional[dict]] = {}  # finished (a record) or skipped (None), not yet written
        self._next = 0
        self._advance()

    def _lock_file(self) -> None:
        if fcntl is None:
            return
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise OutputError(f"--out {self.path} is being written by another regeneration run; wait for it to end "
                              f"or pass another --out") from None

    def _resume(self, prompts: list[Prompt]) -> None:
        data = self.path.read_bytes()
        keep = data.rfind(b"\n") + 1  # complete lines only: a kill mid-write leaves a torn last one
        for lineno, line in enumerate(data[:keep].splitlines(), start=1):
            record = _done_record(line)
            index = None if record is None else record.get("index")
            if not isinstance(index, int) or not 0 <= index < len(prompts):
                raise PromptError(f"--out {self.path}:{lineno} is not a record of this prompt file; pass a new --out "
                                  f"(or delete it to start over)")
            if not prompts[index].matches(record):
                raise PromptError(f"--out {self.path}:{lineno} holds record {index} of another prompt file (its prompt "
                                  f"differs); pass a new --out (or delete it to start over)")
            if index in self.done:
                raise PromptError(f"--out {self.path}:{lineno} repeats record {index}; pass a new --out")
            self.done.add(index)
        if keep < len(data):
            if not RECORD_START.startswith(data[keep:keep + len(RECORD_START)]):
                raise PromptError(f"--out {self.path} ends in a line that is not a record this command writes (nor "
                                  f"one a kill cut short); pass a new --out (or delete it to start over)")
            with open(self.path, "r+b") as f:
                f.truncate(keep)
                f.flush()
                os.fsync(f.fileno())

    def put(self, record: dict) -> None:
        """A finished record; written once every index before it is written or skipped."""
        with self._lock:
            self._waiting[record["index"]] = record
            self._advance()

    def skip(self, index: int) -> None:
        """An index that gets no record in this run."""
        with self._lock:
            self._waiting[index] = None
            self._advance()

    @property
    def waiting(self) -> int:
        """Finished records held back until the ones before them are written."""
        with self._lock:
            return sum(r is not None for r in self._waiting.values())

    def _advance(self) -> None:
        while self._next < self._count:
            if self._next in self.done:
                self._next += 1
            elif self._next in self._waiting:
                record = self._waiting.pop(self._next)
                if record is not None:
                    self._write(record)
                self._next += 1
            else:
                return

    def _write(self, record: dict) -> None:
        self._file.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        self._file.flush()
        os.fsync(self._file.fileno())
        self.done.add(record["index"])

    def close(self) -> None:
        with self._lock:
            self._file.close()  # closing drops the lock


def _done_record(line: bytes) -> Optional[dict]:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None
