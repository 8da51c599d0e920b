"""The bounds a config field may take, by name: one way to declare them in every config.

The run's config (``protocol.runconfig``), the coordinator's sections (``coordinator.base``),
the node's settings (``node.daemon.settings``) and the node-side tools' configs all bound their
numbers with these, so ``heartbeat_timeout_s: Positive = 30.0`` reads as what it allows and the
same bound is written the same way everywhere. A field with a bound of its own (an upper limit,
a pattern) keeps a plain ``Field``; a named bound also takes one for its description
(``inner_steps: Count = Field(30, description=...)``). Pydantic checks and documents them as it
does ``Field(gt=0)``: the JSON schema and the error messages are the same.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

#: One or more: counts of things, every-N intervals that cannot be 0.
Count = Annotated[int, Field(ge=1)]
#: Zero or more; where 0 means "never" or "the default", the field's comment says which.
Natural = Annotated[int, Field(ge=0)]
#: Greater than 0: durations in seconds, rates, learning rates, scales.
Positive = Annotated[float, Field(gt=0)]
#: Zero or more: margins, grace periods, decay.
NonNegative = Annotated[float, Field(ge=0)]
#: From 0 to 1 inclusive: ratios and shares.
Fraction = Annotated[float, Field(ge=0, le=1)]
