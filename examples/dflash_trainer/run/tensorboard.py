"""``--tensorboard DIR``: the training log's records as TensorBoard scalars (torch.utils.tensorboard),
written by the leader: loss, accuracy, gradient norm, learning rate and tokens/s every log interval,
tau at every evaluation, and each worker's mean step time over the interval."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Iterable, Optional

from ..errors import BadInput

log = logging.getLogger("dflash")

TRAIN_SCALARS = ("loss", "acc", "acc_k1", "grad_norm", "lr", "tokens_per_s")


def check_directory(directory: str) -> None:
    """Refuse a ``--tensorboard DIR`` that is a file or that cannot be created or written, before the run
    builds anything (it is created here, as SummaryWriter would)."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise BadInput(f"--tensorboard {directory} is a file, not a directory; pass a directory for the events") from None
    except OSError as err:
        raise BadInput(f"--tensorboard {directory} cannot be created ({err.strerror or err}); pass a directory you "
                       f"can write") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise BadInput(f"--tensorboard {directory} is not writable; pass a directory you can write")


class TensorBoardLog:
    """A sink for TrainingLog records; ``workers()`` gives the run's workers (``name`` and ``phases``,
    a PhaseTimes), read at each training record for their step times since the last one."""

    def __init__(self, directory: str, workers: Callable[[], Iterable]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise BadInput(f"--tensorboard needs the tensorboard package ({err}); pip install tensorboard, or drop "
                           f"--tensorboard") from None
        try:
            self.writer = SummaryWriter(log_dir=directory)
        except OSError as err:  # gone or locked since check_directory
            raise BadInput(f"--tensorboard {directory} cannot be written ({err.strerror or err}); pass a directory "
                           f"you can write") from None
        self.directory, self._workers = directory, workers
        self._read: dict[str, int] = {}  # step times of each worker already written
        log.info("dflash: TensorBoard events in %s (tensorboard --logdir %s)", directory, directory)

    def chain(self, progress: Optional[Callable[[dict], None]]) -> Callable[[dict], None]:
        """A progress callback that writes the record here, then passes it on to ``progress``."""
        def record(rec: dict) -> None:
            self.write(rec)
            if progress is not None:
                progress(rec)
        return record

    def write(self, record: dict) -> None:
        step = record.get("step")
        if step is None:
            return
        if "loss" in record:
            for name in TRAIN_SCALARS:
                if name in record:
                    self.writer.add_scalar(f"train/{name}", float(record[name]), step)
            self._step_times(step)
        for name, value in record.items():
            if name.startswith("eval_") and isinstance(value, (int, float)):
                self.writer.add_scalar(f"eval/{name[len('eval_'):]}", float(value), step)
        self.writer.flush()

    def _step_times(self, step: int) -> None:
        for worker in self._workers():
            times = worker.phases.step_ms
            done = len(times)
            new = times[self._read.get(worker.name, 0):done]
            self._read[worker.name] = done
            if new:
                self.writer.add_scalar(f"step_time_ms/{worker.name}", sum(new) / len(new), step)

    def close(self) -> None:
        self.writer.close()
