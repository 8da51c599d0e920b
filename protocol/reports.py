"""What a node reports after applying a round (``POST /v1/rounds/{r}/report``): its fingerprint of
θ, the peers it rejected, losses, bytes, phase times, throughput and its error-feedback mass.

The coordinator stores every report and shows the recent ones in its status
(``protocol.status``), so each number in it is bounded here: a stored report always validates
again and serialises to plain JSON.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from protocol.messages import FingerprintHex, Message, NodeId

# Numbers in request bodies: the JSON type is kept (``true`` is not a number, ``1.0`` not an
# integer, ``"1"`` neither), no NaN or infinity gets in, and every value has a range, so a stored
# report always validates again and serialises to plain JSON.
#: Largest count (bytes moved, retries) a report may carry: exact in a float64 and in JSON.
MAX_COUNT = (1 << 53) - 1
#: A loss in nats per token; 1e6 is far above any real one (a byte-level model starts at ~5.5).
MAX_LOSS = 1e6
#: A phase time in seconds: about 116 days.
MAX_SECONDS = 1e7
#: A mass account's sums (Σ over every entry of a model of billions of parameters).
MAX_MASS = 1e18
#: Most phases one report may time, and most peers it may say it rejected.
MAX_PHASES = 32
MAX_REJECTED = 4096

Count = Annotated[int, Field(strict=True, ge=0, le=MAX_COUNT)]
Loss = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0, le=MAX_LOSS)]
Seconds = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0, le=MAX_SECONDS)]
MassSum = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=-MAX_MASS, le=MAX_MASS)]
MassScale = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0, le=MAX_MASS)]
#: A node's training throughput (1e12 tokens/s is beyond any device), and a percentage (MFU).
TokensPerSecond = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0, le=1e12)]
Percent = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0, le=100)]
PhaseName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,31}$")]
Reason = Annotated[str, StringConstraints(max_length=256)]
#: What cut a node's round short (``RoundReport.cut``).
Cut = Literal["compute", "link", "observing"]


class Mass(Message):
    """Where this round's error-fed signal went (float64 sums over every tensor's entries).

    ``computed`` = Σ(β·e + Δ) before compression; ``sent`` = Σ of the decoded payload if it was
    aggregated, else 0; ``held`` = Σ e after the round. Nothing is lost when
    computed == sent + held, up to rounding (``scale`` = Σ|β·e + Δ| sets the tolerance).
    """

    computed: MassSum
    sent: MassSum
    held: MassSum
    scale: MassScale


class RoundReport(Message):
    """What a node reports after applying a round."""

    fingerprint: FingerprintHex = Field(description="fingerprint of θ after applying the round")
    rejected: dict[NodeId, Reason] = Field(
        default_factory=dict,
        max_length=MAX_REJECTED,
        description="gathered payloads this node could not use, and why",
    )
    train_loss: Loss | None = None
    eval_loss: Loss | None = None
    bytes_up: Count = 0
    bytes_down: Count = 0
    timings: dict[PhaseName, Seconds] = Field(
        default_factory=dict,
        max_length=MAX_PHASES,
        description="seconds per phase of the round on this node",
    )
    mass: Mass | None = Field(
        None, description="error-feedback accounting of this node's own contribution"
    )
    retries: Count = Field(
        0, description="failed attempts at the coordinator or the store since the last report"
    )
    tokens_per_s: TokensPerSecond | None = Field(
        None, description="tokens per second of the round's inner steps on this node"
    )
    mfu: Percent | None = Field(
        None,
        description="model FLOPs utilisation of the inner steps (of the device's peak bf16"
        " FLOP/s); absent on the CPU or a device of unknown peak",
    )
    steps: Count | None = Field(
        None, description="inner steps the node trained in the round (its payload's)"
    )
    tokens: Count | None = Field(None, description="tokens those steps read")
    cut: Cut | None = Field(
        None,
        description="what ended its training before the run's H steps: its time budget"
        ' ("compute"), or its link\'s share of it ("link": it also sent fewer entries per'
        ' tile); or that it could not get a payload in at all ("observing": it applies every'
        " round and submits none); absent: H steps",
    )
    topk: Count | None = Field(
        None, description="entries per tile it sent, when its link carried fewer than the run's"
    )
