"""One round's inner training: H AdamW steps on the node's own data stream.

The worker (``node.compute.worker``) owns θ, the error buffer and the codec; this module owns
only what happens between "θ_r copied into the model" and "the model holds the trained
parameters": which batch each global step draws, the learning rate it runs at, and the
optimiser step. Kept apart because it is the one part of a round that differs per device and
per process layout; everything before and after it is the same bit for bit on every node.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from node.compute.data import Corpus
from node.compute.model import LanguageModel
from node.compute.optim import InnerOptimConfig, inner_step
from node.errors import Abandoned
from protocol.runconfig import RunConfig

if TYPE_CHECKING:
    from node.compute.ranks import Ranks


@dataclass
class InnerLoop:
    """The inner steps of one participant: its model, optimiser and data stream."""

    run: RunConfig
    model: LanguageModel
    opt: torch.optim.Optimizer
    cfg: InnerOptimConfig
    corpus: Corpus
    #: The node's data slot (``slot % run.data_slots`` picks its stream).
    slot: int
    #: The node's processes under torchrun (``node.compute.ranks``): this one trains on its
    #: rows of each batch and averages gradients with the others. None: a single process.
    ranks: Ranks | None = None

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(x, y)`` batch of global inner step ``step``: a pure function of the step."""
        return self.corpus.train_batch(
            worker=self.slot % self.run.data_slots,
            n_workers=self.run.data_slots,
            step=step,
            batch_size=self.run.batch_size,
            seed=self.run.seed,
        )

    def train(
        self,
        round_: int,
        *,
        lr_scale: Callable[[], float],
        stop: threading.Event,
        on_step: Callable[[], None] | None = None,
    ) -> list[float]:
        """H inner steps of round ``round_`` on the model as it is; the batch losses.

        ``lr_scale`` is asked before each step (the re-warm-up factor moves with the node's
        step count, which ``on_step`` advances). Raises ``Abandoned`` if ``stop`` is set
        between two steps; the model then holds a partly trained state the caller discards.
        """
        H = self.run.inner_steps
        losses = []
        for h in range(H):
            if stop.is_set():
                raise Abandoned()
            step = round_ * H + h
            x, y = self.batch(step)
            sync = None
            if self.ranks is not None:
                x, y, sync = self.ranks.share(x), self.ranks.share(y), self.ranks.sync
            losses.append(
                inner_step(
                    self.model,
                    self.opt,
                    x,
                    y,
                    step=step,
                    cfg=self.cfg,
                    lr_scale=lr_scale(),
                    grad_sync=sync,
                )
            )
            if on_step is not None:
                on_step()
        return losses
