"""Preemption: a cluster's SIGTERM (or SLURM's SIGUSR1 ahead of the time limit) ends a run cleanly.

    with Preemption() as preemption:       # in fit(), on the main thread
        ...
        stop = preemption.requested        # this rank's flag; the trainer agrees on it across ranks

On the first signal the handler only sets a flag: the current optimizer step finishes, every rank
learns of it in the step's first all_reduce (a rank's flag travels with the label-weight sum the
step reduces anyway, so agreeing costs no extra collective), all ranks stop after the same step,
the trainer writes a checkpoint synchronously, logs a `preempted` event, leaves
`run_dir/preempted.json` and exits with EXIT_PREEMPTED (75, EX_TEMPFAIL: "try again"). The same
command resumes exactly from that step, with no step lost or trained twice. The default handlers
come back at once: a second SIGTERM (or the cluster's SIGKILL after its grace period) kills the
process, and the commit protocol keeps the previous checkpoint intact.

Under torchrun every rank gets the signal from the agent and exits 75; torchrun itself then exits 1,
so a job script tells a preemption by the marker file, not by torchrun's status.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from shared.errors import UserError

EXIT_PREEMPTED = 75  # sysexits EX_TEMPFAIL
SIGNALS = ("SIGTERM", "SIGUSR1")


class Preempted(UserError):
    """The run stopped on a signal after saving; the message says where and how to resume."""

    exit_code = EXIT_PREEMPTED


class Preemption:
    """Installs the handlers while the block runs (main thread only; elsewhere it does nothing)."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for name in SIGNALS:
                number = getattr(signal, name, None)
                if number is not None:
                    self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _handle(self, number: int, _frame: FrameType | None) -> None:
        self.requested = signal.Signals(number).name
        for name in SIGNALS:  # a second signal ends the process the usual way
            other = getattr(signal, name, None)
            if other is not None:
                signal.signal(other, signal.SIG_DFL)
