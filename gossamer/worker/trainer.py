"""The trainers' public names in one import (the parameter-server trainer is `ParameterServerTrainer`)."""

from __future__ import annotations

from gossamer.worker.layout import loss_sum
from gossamer.worker.model import build, evaluate
from gossamer.worker.ps_trainer import ParameterServerTrainer
from gossamer.worker.rank import Hook, RankContext, StepAbandoned, StepStats
from gossamer.worker.rank_trainer import OnSaved, RankTrainer

#: The parameter-server trainer under its first name (tests and benches import it).
Trainer = ParameterServerTrainer

__all__ = [
    "Hook",
    "OnSaved",
    "ParameterServerTrainer",
    "RankContext",
    "RankTrainer",
    "StepAbandoned",
    "StepStats",
    "Trainer",
    "build",
    "evaluate",
    "loss_sum",
]
