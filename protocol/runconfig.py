"""The run configuration: everything every node must agree on, and the run id derived from it.

The coordinator holds one ``RunConfig`` and hands it to each node that joins; its hash is the
run id, so two runs with any difference in model, codec, optimiser, schedule or timing can never
be mixed up in the object store or the coordinator's database. Node-local choices (data path,
threads, state directory) are not part of it.

The model is named by preset (``node.compute.model.PRESETS``); the coordinator never builds it,
but checks the name against ``MODEL_PRESETS``, the names every node of this release builds, so a
typo is refused where it is written (with the nearest name), not by each node after it joined.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from protocol.bounds import Count, Fraction, Natural, NonNegative, Positive

#: What nodes exchange, as one version: 3 is payload format 3 (``protocol/FORMAT.md``: the work a
#: payload carries, a k per tile up to the run's) with fingerprint version 2
#: (``protocol.fingerprint``) and rounds with a time budget. Part of the run id
#: (``RunConfig.canonical``).
PROTOCOL = 3
#: The model presets a node of this release builds, in ``node.compute.modelconfig.PRESETS``'s
#: order (which checks at import that it holds exactly these).
MODEL_PRESETS = (
    "tiny", "small", "base", "medium", "large", "1b", "llama_tiny", "llama_small", "llama_bpe4k",
    "llama_bpe4k_1m", "llama_bpe4k_12m", "llama_bpe4k_4m", "llama_moe", "llama_moe_645m",
    "llama_512m", "llama_1b",
)  # fmt: skip
#: Hex digits of the sha256 of the canonical config kept as the run id.
RUN_ID_HEX = 16
#: τ of ``overlap = "merge"`` when the run does not set ``overlap_tau`` (docs/benchmarks.md §12).
DEFAULT_MERGE_STEP = 1
#: With neither ``overlap_tau`` nor ``overlap_rows`` set, "merge" comes inside the first step,
#: after the gradients of this share of its batch (at least one row; docs/benchmarks.md §12).
DEFAULT_MERGE_SHARE = 0.25
#: A dataset id: the sha256 of a prepared dataset's canonical manifest (``protocol.dataset``).
DATASET_ID_PATTERN = r"^sha256:[0-9a-f]{64}$"
#: How peers that trained unequal numbers of inner steps in a round count in its aggregate
#: (``node.compute.work``).
WorkRule = Literal["mean", "steps", "per_step"]
#: A round's time budget: learnt from what the members measured ("median": the time the median
#: member needs for H inner steps, end to end; "fastest": the fastest member's), a fixed number
#: of seconds, or "off" (every node trains H steps and the round waits for it, up to its deadline).
Budget = Union[Literal["median", "fastest", "off"], Positive]  # noqa: UP007 (pydantic's order)


class Timing(BaseModel):
    """How long a round may take before it closes without the missing nodes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Deadline of a round with no history yet, counted from when its first node is expected.
    first_round_s: Positive = 300.0
    #: Later deadlines: ``factor`` times the median of recent round durations, plus ``margin_s``,
    #: clamped to [min_round_s, max_round_s].
    factor: float = Field(2.0, ge=1.0)
    margin_s: NonNegative = 10.0
    min_round_s: Positive = 15.0
    max_round_s: Positive = 3600.0
    #: A member with no heartbeat for this long is timed out and no longer expected.
    heartbeat_timeout_s: Positive = 30.0
    #: A member that submitted nothing in this many rounds in a row is no longer waited for: it
    #: stays a member and may submit, and is waited for again from the round after it does.
    silent_rounds: Count = 2
    #: The round's time budget, which the coordinator names in the round view
    #: (``coordinator.rules.budget``): a node trains until H steps or until its budget runs out
    #: (the budget's end less its own encode, upload and margin), whichever comes first, and
    #: submits on time. "median" (the default): the time the median member needs for a whole
    #: round of H steps, learnt from the recent rounds; "fastest": the fastest member's; a
    #: number: that many seconds from the round's opening; "off": no budget.
    budget: Budget = "median"

    @field_validator("budget", mode="before")
    @classmethod
    def _budget_value(cls, value: Any) -> Any:
        """One clear error for a budget that is neither a name nor a number of seconds."""
        named = value in ("median", "fastest", "off")
        number = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        if not (named or number):
            raise ValueError(
                f'budget must be "median", "fastest", "off" or a number of seconds above'
                f" 0, got {value!r}"
            )
        return value

    @property
    def fixed_budget_s(self) -> float | None:
        """The budget in seconds when the run fixes one (a number); None otherwise."""
        return None if isinstance(self.budget, str) else float(self.budget)

    @model_validator(mode="after")
    def _check(self) -> Timing:
        if self.min_round_s > self.max_round_s:
            raise ValueError(
                f"min_round_s={self.min_round_s} exceeds max_round_s={self.max_round_s}"
            )
        return self


class RunConfig(BaseModel):
    """The shared definition of one training run (DESIGN.md defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("demo", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    #: Model preset name (``MODEL_PRESETS``), built by the node.
    model: str = Field("tiny", min_length=1, max_length=32, pattern=r"^[a-z0-9_]+$")
    seed: Natural = 0
    #: Total rounds of the run; the inner learning-rate schedule spans rounds x inner_steps.
    rounds: Count = 20
    inner_steps: Count = Field(30, description="H, inner AdamW steps per round")
    batch_size: Count = 8
    # Codec
    topk: Count = Field(64, description="kept entries per 4096-element tile")
    tile: int = Field(64, ge=1, le=1024)
    # Outer step
    beta: Fraction = 0.95
    alpha: Positive = 1.0
    clip: bool = True
    #: Screen peers by sign agreement and bound every value's influence (node.compute.robust).
    robust: bool = True
    #: Overlap communication with compute: round r trains from θ_{r-1}, without round r-1's
    #: aggregate, which is applied once round r's training ends (one round of delay), so a
    #: round's transfers run while the next round trains. "delayed" starts that training from
    #: θ_{r-1} itself; "eager" from θ_{r-1} minus the node's estimate of the step round r-1's
    #: aggregate will take (its own update for a 1/G share, the previous aggregate's step for
    #: the rest). What every node applies and agrees on is the same in both; only where each
    #: node's local training starts differs. "merge" also trains round r from θ_{r-1}, but
    #: applies round r-1's aggregate at inner step ``merge_step`` of round r (the node waits
    #: there for it) and adds the step it takes to the parameters being trained, so round r's
    #: payload is trained from θ_r as without overlap (``node.compute.merge``).
    overlap: Literal["off", "delayed", "eager", "merge"] = "off"
    #: (overlap = "merge") τ, the inner step of a round at which the previous round's aggregate
    #: is merged, 1 <= τ <= H; None: ``DEFAULT_MERGE_STEP`` (or H, if H is smaller).
    overlap_tau: Count | None = None
    #: (overlap = "merge") Rows of step τ's batch whose gradients are taken before the merge,
    #: 1 <= rows < batch_size: the merge then comes inside step τ, between those rows and the
    #: rest, and step τ itself is taken after it. None: the merge follows the whole of step τ
    #: if the run sets ``overlap_tau``, else it comes ``DEFAULT_MERGE_SHARE`` into step 1.
    overlap_rows: Count | None = None
    # Inner optimiser
    inner_lr: Positive = 1e-3
    warmup_frac: Fraction = 0.05
    #: Steps of linear re-warm-up for a node starting with a fresh AdamW state mid-run.
    rewarmup_steps: Natural = 10
    # Membership and rounds
    gather_size: Count = Field(16, description="G, most payloads aggregated per round")
    #: How payloads of unequal work count (``node.compute.work``): "steps" (the default), the
    #: contributor mean weighted by each payload's inner steps; "mean", every payload once;
    #: "per_step", each payload scaled to a whole round's steps before clipping.
    work_weight: WorkRule = "steps"
    #: Data is cut into this many disjoint streams; a node trains on stream slot % data_slots.
    data_slots: Count = 16
    #: Rounds wait (state "waiting") until at least this many members are active.
    min_nodes: Count = 1
    # Checkpoints and retention
    #: A checkpoint of θ_R is taken at every round R that is a multiple of this (0: never).
    checkpoint_every: Natural = 10
    #: Payloads of rounds older than this many rounds, and older than the newest checkpoint,
    #: are deleted. Must exceed checkpoint_every so a joiner can always replay from a checkpoint.
    retention_rounds: Count = 30
    #: Checkpoints kept in the store (the newest ones).
    keep_checkpoints: Count = 2
    # Evaluation
    #: Nodes measure the held-out loss of θ after the first round, after the last one and
    #: after every round R with (R + 1) a multiple of this (``evaluates``); 1: every round.
    eval_every: Count = 10
    #: The prepared dataset every node trains on, by id (``sparseloco data prepare`` prints
    #: it); nodes stream their own shards of it from the store. None: each node's local data.
    dataset: str | None = Field(None, pattern=DATASET_ID_PATTERN)
    timing: Timing = Timing()

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        if value not in MODEL_PRESETS:
            near = difflib.get_close_matches(value, MODEL_PRESETS, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ValueError(
                f"unknown model preset {value!r}; {hint}choose one of: {', '.join(MODEL_PRESETS)}"
            )
        return value

    @field_validator("overlap", mode="before")
    @classmethod
    def _overlap_flag(cls, value: Any) -> Any:
        """``true``/``false`` as written before the variants existed: delayed, off."""
        if isinstance(value, bool):
            return "delayed" if value else "off"
        return value

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.topk > self.tile * self.tile:
            raise ValueError(f"topk={self.topk} exceeds tile**2={self.tile**2}; lower topk")
        if self.checkpoint_every and self.retention_rounds <= self.checkpoint_every:
            raise ValueError(
                f"retention_rounds={self.retention_rounds} must exceed checkpoint_every="
                f"{self.checkpoint_every}, or a joiner could find neither payloads nor a"
                " checkpoint to start from; raise retention_rounds"
            )
        if self.overlap_tau is not None:
            if self.overlap != "merge":
                raise ValueError(
                    f'overlap_tau={self.overlap_tau} applies to overlap = "merge" only'
                    f' (overlap is {self.overlap!r}); set overlap = "merge" or drop overlap_tau'
                )
            if self.overlap_tau > self.inner_steps:
                raise ValueError(
                    f"overlap_tau={self.overlap_tau} exceeds inner_steps={self.inner_steps}: the"
                    " aggregate must be merged within the round; lower overlap_tau"
                )
        if self.work_weight == "per_step" and not self.clip:
            raise ValueError(
                'work_weight = "per_step" scales a payload of fewer steps up, and only'
                " median-norm clipping bounds what a claim of fewer steps then buys: set"
                ' clip = true, or work_weight = "steps"'
            )
        if self.overlap_rows is not None:
            if self.overlap != "merge":
                raise ValueError(
                    f'overlap_rows={self.overlap_rows} applies to overlap = "merge" only'
                    f' (overlap is {self.overlap!r}); set overlap = "merge" or drop overlap_rows'
                )
            if self.overlap_rows >= self.batch_size:
                raise ValueError(
                    f"overlap_rows={self.overlap_rows} must be below batch_size="
                    f"{self.batch_size}: the merge comes between two parts of a step's batch"
                    " (leave overlap_rows out to merge after the whole step)"
                )
        return self

    def canonical(self) -> bytes:
        """The config as canonical JSON bytes (sorted keys, no spaces): what the run id hashes.

        ``protocol`` (``PROTOCOL``) is in it: nodes of different protocol versions cannot train
        together, so a run of another version has another id, and a coordinator database or a
        node's state of it is refused at start rather than failing later. ``overlap`` was a
        boolean before its variants existed; "off" and "delayed" are written as that boolean
        still; a run without a ``dataset`` or an ``overlap_tau`` leaves the key out."""
        document = self.model_dump(mode="json")
        document["protocol"] = PROTOCOL
        if document["overlap"] in ("off", "delayed"):
            document["overlap"] = document["overlap"] == "delayed"
        if document["dataset"] is None:
            del document["dataset"]  # likewise for runs on local data
        for key in ("overlap_tau", "overlap_rows"):
            if document[key] is None:
                del document[key]  # likewise for runs before "merge" and its settings existed
        return canonical_json(document)

    @property
    def run_id(self) -> str:
        """``{name}-{hash}``: readable, and different for any change to the config."""
        digest = hashlib.sha256(self.canonical()).hexdigest()[:RUN_ID_HEX]
        return f"{self.name}-{digest}"

    def evaluates(self, round_: int) -> bool:
        """Whether nodes evaluate θ after round ``round_`` (0-based): the first and the last
        round always, so a run's loss curve has both ends, and every ``eval_every``-th."""
        return round_ == 0 or round_ == self.rounds - 1 or (round_ + 1) % self.eval_every == 0

    @property
    def overlaps(self) -> bool:
        return self.overlap != "off"

    @property
    def merge_step(self) -> int | None:
        """(overlap = "merge") τ: after this many inner steps of round r+1, round r's aggregate
        is merged; None for the other schedules."""
        if self.overlap != "merge":
            return None
        if self.overlap_tau is not None:
            return self.overlap_tau
        return min(DEFAULT_MERGE_STEP, self.inner_steps)

    @property
    def merge_rows(self) -> int | None:
        """(overlap = "merge") The rows of step τ's batch taken before the merge; None: the
        merge follows the whole step (and for the other schedules). A run that sets neither
        τ nor the rows merges ``DEFAULT_MERGE_SHARE`` of the way into its first step."""
        if self.overlap != "merge":
            return None
        if self.overlap_rows is not None or self.overlap_tau is not None:
            return self.overlap_rows
        rows = max(1, round(DEFAULT_MERGE_SHARE * self.batch_size))
        return rows if rows < self.batch_size else None

    def base_round(self, round_: int) -> int | None:
        """The round whose aggregate was the last one in θ that round ``round_``'s payloads are
        trained from: the nodes' reports of that round (the fingerprint after applying it) say
        what the base must be. None when the base is θ_0 (round 0, and round 1 with a delayed
        or eager overlap). With "merge" a payload's base is θ after the previous round, as
        without overlap: the aggregate in flight is merged before the round's training ends."""
        base = round_ - (2 if self.late_base else 1)
        return base if base >= 0 else None

    @property
    def late_base(self) -> bool:
        """Whether a round's payloads are trained from θ one aggregate behind ("delayed",
        "eager"); with "merge" the aggregate in flight is merged before training ends."""
        return self.overlap in ("delayed", "eager")

    @property
    def total_inner_steps(self) -> int:
        return self.rounds * self.inner_steps

    @property
    def warmup_steps(self) -> int:
        total = self.total_inner_steps
        return min(total, max(1, round(self.warmup_frac * total)))


def canonical_json(value: Any) -> bytes:
    """Deterministic JSON encoding used for hashing and signing."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
