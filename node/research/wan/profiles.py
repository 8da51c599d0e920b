"""Link profiles: the commodity-internet links the WAN lab puts between a node and the store.

A profile is what one node's access link looks like from the node: its upload and download
rates, its round-trip time to the store and coordinator (with jitter), and whether the path
resets TCP connections now and then (a NAT or middlebox timing out, a flaky modem). The lab
(``node.research.wan.lab``) shapes the rates with ``tc tbf`` on the node's veth and leaves
delay, jitter and resets to the node's relay (``node.research.wan.relay``).

The four named profiles are those of issue 20; ``with_reset`` gives the flaky one a shorter
period for tests that cannot wait a minute between resets.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class LinkProfile:
    """One node's access link: rates in Mbit/s (10^6 bit/s), times in milliseconds/seconds."""

    name: str
    up_mbit: float
    down_mbit: float
    rtt_ms: float
    #: The round trip varies by up to ± this much (each direction by half of it).
    jitter_ms: float = 0.0
    #: About every this many seconds one live TCP connection through the link is reset
    #: (RST on both ends); None: never.
    reset_every_s: float | None = None

    def __post_init__(self) -> None:
        if self.up_mbit <= 0 or self.down_mbit <= 0:
            raise ValueError(f"profile {self.name!r}: rates must be positive Mbit/s")
        if self.rtt_ms < 0 or self.jitter_ms < 0 or self.jitter_ms > self.rtt_ms:
            raise ValueError(
                f"profile {self.name!r}: need 0 <= jitter_ms <= rtt_ms"
                f" (got rtt {self.rtt_ms}, jitter {self.jitter_ms})"
            )
        if self.reset_every_s is not None and self.reset_every_s <= 0:
            raise ValueError(f"profile {self.name!r}: reset_every_s must be positive or None")

    def with_reset(self, every_s: float | None) -> LinkProfile:
        """The same link with another reset period (tests: a few seconds, not a minute)."""
        return replace(self, reset_every_s=every_s)

    def describe(self) -> str:
        """One line for logs and tables: ``home 20/100 Mbit 40±0 ms``."""
        text = f"{self.name} {self.up_mbit:g}/{self.down_mbit:g} Mbit {self.rtt_ms:g}"
        text += f"±{self.jitter_ms:g} ms"
        if self.reset_every_s is not None:
            text += f" reset~{self.reset_every_s:g}s"
        return text


HOME = LinkProfile("home", up_mbit=20, down_mbit=100, rtt_ms=40)
OFFICE = LinkProfile("office", up_mbit=100, down_mbit=100, rtt_ms=20)
FAR = LinkProfile("far", up_mbit=50, down_mbit=50, rtt_ms=150, jitter_ms=30)
FLAKY = LinkProfile("flaky", up_mbit=20, down_mbit=100, rtt_ms=40, reset_every_s=60.0)

#: The named profiles: ``PROFILES["flaky"].with_reset(15)`` for a test's shorter period.
PROFILES: dict[str, LinkProfile] = {p.name: p for p in (HOME, OFFICE, FAR, FLAKY)}
