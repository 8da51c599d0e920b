"""One round's inner training: H AdamW steps on the node's own data stream.

The worker (``node.compute.worker``) owns θ, the error buffer and the codec; this module owns
only what happens between "θ_r copied into the model" and "the model holds the trained
parameters": which batch each global step draws, the learning rate it runs at, and the
optimiser step. Kept apart because it is the one part of a round that differs per device and
per process layout; everything before and after it is the same bit for bit on every node.

On a node of several ranks the model is FSDP's (``node.compute.fsdp``) and every rank runs this
same loop: each reads the node's batch of the step from the data (a pure function of the step,
so no rank sends another one anything) and trains on its rows ``rank::world`` of it; FSDP
reduces the gradients. Whether to stop is agreed before every step (``Group.any``), so all
ranks leave a round at the same step, and so is whether the round's time budget ends it early
(``cut``, asked of rank 0 only): a node trains until H steps or its budget, whichever comes first
(``node.compute.linkbudget``). Every step draws the batch and the learning rate of its global
step, round × H + h, so a round cut short leaves the node on the run's schedule: the next round
starts at (round + 1) × H like everyone's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from node.compute.data import Corpus
from node.compute.group import Group
from node.compute.model import LanguageModel
from node.compute.optim import InnerOptimConfig, inner_step
from node.errors import Abandoned, RanksError
from protocol.runconfig import RunConfig


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
    #: The node's processes (``node.compute.group``): this one trains on its rows of each
    #: batch; FSDP averages the gradients. One process by default.
    group: Group = field(default_factory=Group.solo)

    def __post_init__(self) -> None:
        if self.run.batch_size < self.group.world:
            raise RanksError(
                f"the run's batch_size {self.run.batch_size} is smaller than this node's"
                f" {self.group.world} processes: each needs at least one row of every batch;"
                f" start the node with --ranks {self.run.batch_size} or fewer"
            )

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
        pause: tuple[int, int, Callable[[], None]] | None = None,
        cut: Callable[[], bool] | None = None,
        min_steps: int = 1,
    ) -> list[float]:
        """Up to H inner steps of round ``round_`` on the model as it is; the batch losses (one
        per step taken).

        ``cut`` is asked before every step from the ``min_steps``-th on (at least one step is
        always taken, and with a merge at step τ the steps up to τ): True ends the round's
        training there, as a time budget that ran out does; the steps taken stand.

        ``lr_scale`` is asked before each step (the re-warm-up factor moves with the node's
        step count, which ``on_step`` advances). Raises ``Abandoned`` if ``stop`` is set
        between two steps; the model then holds a partly trained state the caller discards.
        ``pause`` = (τ, rows, fn): inside the round's τ-th step, ``fn`` runs between the
        gradients of the batch's first ``rows`` rows and the rest (``inner_step``); on a node
        of several processes each rank pauses after those of its rows ``rank::world`` that are
        among the batch's first ``rows`` (``local_rows``), so the node's two parts are the
        single process's.
        """
        H = self.run.inner_steps
        group = self.group
        losses = []
        for h in range(H):
            asked = cut is not None and h >= min_steps and cut()
            stop_now, cut_now = group.flags([stop.is_set(), asked], "agreeing whether to stop")
            if stop_now:
                raise Abandoned()
            if cut_now:
                break
            step = round_ * H + h
            x, y = self.batch(step)
            weight, node_loss = 1.0, None
            if group.world > 1:
                batch = x.shape[0]
                x, y = x[group.rank :: group.world], y[group.rank :: group.world]
                share = x.shape[0] / batch
                weight = group.world * share

                def node_loss(loss: torch.Tensor, share: float = share) -> float:
                    parts = group.gather_floats([loss.item() * share], "adding up the loss")
                    return sum(p[0] for p in parts)

            losses.append(
                inner_step(
                    self.model,
                    self.opt,
                    x,
                    y,
                    step=step,
                    cfg=self.cfg,
                    lr_scale=lr_scale(),
                    weight=weight,
                    node_loss=node_loss,
                    pause=(
                        (local_rows(pause[1], group), pause[2])
                        if pause is not None and h + 1 == pause[0]
                        else None
                    ),
                )
            )
            if on_step is not None:
                on_step()
        return losses


def local_rows(rows: int, group: Group) -> int:
    """How many of this rank's rows (``rank::world`` of the node's batch) are among the batch's
    first ``rows``: where this rank's part of a step pauses for the merge (0 on a rank whose
    first row comes later)."""
    return max(0, -(-(rows - group.rank) // group.world))
