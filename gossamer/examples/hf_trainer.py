"""A Hugging Face `Trainer` inside a train function: a GPT-2 or Llama built from a config, this worker's data."""

from __future__ import annotations

import math
import tempfile
from typing import Any

import torch
from torch.utils.data import Subset

from gossamer.examples import gpt2


def train(ctx: Any, arch: str = "gpt2", batch_size: int = 8, lr: float = 3e-3, warmup: int = 10) -> None:
    """`transformers.Trainer` with gossamer's prepared model and optimizer (AdamW, betas 0.9 and 0.95).

    The Trainer keeps its own loop, DataLoader and logging; the prepared optimizer's `step()` does the
    mode's exchange, and a callback ends training when the run is over and reports the Trainer's logs.
    """
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model = gpt2.model(arch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    model, optimizer = ctx.prepare(model, optimizer)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    train_set, eval_set = gpt2.data(max_bytes=200_000)
    mine = Subset(train_set, range(ctx.rank, len(train_set), ctx.world_size))  # this worker's share

    class Gossamer(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if ctx.should_stop():
                control.should_training_stop = True

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
                   **kwargs: Any) -> None:
            figures = {k: float(v) for k, v in (logs or {}).items() if k in ("loss", "grad_norm", "learning_rate")}
            if figures:
                ctx.report(**figures)

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=ctx.experiment.total_steps, per_device_train_batch_size=batch_size,
                                 logging_steps=5, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                                 max_grad_norm=1.0, seed=ctx.experiment.seed + ctx.rank, dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=mine, optimizers=(optimizer, schedule),
                          callbacks=[Gossamer()])
        trainer.train()
        if ctx.is_lead:
            loss = trainer.evaluate(Subset(eval_set, range(min(64, len(eval_set)))))["eval_loss"]
            ctx.report(eval_loss=loss, eval_bits_per_byte=loss / math.log(2))
