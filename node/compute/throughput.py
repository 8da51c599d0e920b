"""How fast a node's inner steps run: tokens per second and model FLOPs utilisation (MFU).

MFU is the model's FLOPs per second over the device's peak: 6 FLOPs per matrix parameter per
token (forward and backward), plus the attention scores and their use, 12 · layers · d_model ·
context per token (the PaLM paper's accounting, causal masking not discounted), over the
device's dense bf16 peak. The embedding lookup is not a matrix product; a tied output head is
(it is counted once, as the head).

The peak comes from a small table by ``torch.cuda.get_device_name()`` (datasheet dense bf16
numbers, without sparsity), or from ``SPARSELOCO_PEAK_FLOPS`` (FLOP/s, e.g. ``989e12``) for a
device the table lacks or a clock it gets wrong. On the CPU, or on a GPU neither knows, MFU is
None: a number against a guessed peak would mislead more than no number.

Beside the round's rate, ``StepClock`` times each inner step twice: on the wall clock and in the
process's CPU time, and the report line carries both medians and the torch thread count the
steps ran with. Wall time grows when other processes take the cores; CPU time grows only when
this node does more work per step, so two rounds of one run compared by CPU time tell a node
that slowed itself down (torch put on more threads than ``--threads``: ``protocol.kernels``)
from a busy machine.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from dataclasses import dataclass, field

import torch

from node.compute.model import ModelConfig, param_count

PEAK_ENV = "SPARSELOCO_PEAK_FLOPS"

#: Dense bf16 FLOP/s (datasheets, without sparsity) by a word of the device name; the first
#: match wins, so the more specific names come first ("NVIDIA H100 80GB HBM3", "NVIDIA
#: A100-SXM4-80GB"). Word boundaries keep "L4" from matching an L40.
PEAK_BF16: tuple[tuple[str, float], ...] = (
    (r"H200 NVL", 835e12),
    (r"H100 NVL", 835e12),
    (r"H100 PCIe", 756e12),
    (r"G?H200", 989e12),
    (r"G?H100", 989e12),
    (r"A100", 312e12),
    (r"L40S", 362e12),
    (r"L4", 121e12),
)


def peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of ``device`` in FLOP/s: the environment's, the table's, or None."""
    override = os.environ.get(PEAK_ENV)
    if override:
        try:
            value = float(override)
        except ValueError:
            value = 0.0
        if value > 0:
            return value
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for pattern, peak in PEAK_BF16:
        if re.search(rf"\b{pattern}\b", name):
            return peak
    return None


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token of ``cfg`` (forward and backward); a mixture of experts counts
    the parameters a token goes through (its experts and the router), not every expert."""
    lookup = cfg.vocab_size * cfg.d_model if not cfg.tie_embeddings else 0
    if cfg.arch == "gpt":
        lookup += cfg.ctx_len * cfg.d_model  # learned positions: a lookup too
    matrices = param_count(cfg, active=True) - lookup
    attention = 12 * cfg.n_layers * cfg.d_model * cfg.ctx_len
    return 6.0 * matrices + attention


@dataclass(frozen=True)
class Throughput:
    """The inner steps' speed on one node: what a round's report carries."""

    tokens_per_s: float
    mfu: float | None
    #: Median wall and process-CPU seconds of one inner step, and torch's thread count then.
    step_s: float | None = None
    step_cpu_s: float | None = None
    threads: int | None = None

    def log_fields(self) -> dict[str, str]:
        """For the node's round line: ``tokens_per_s=12345 mfu=0.412 step_s=0.101
        step_cpu_s=0.098 threads=1`` (``-`` when unknown)."""
        mfu = "-" if self.mfu is None else f"{self.mfu:.3f}"
        fields = {"tokens_per_s": f"{self.tokens_per_s:.0f}", "mfu": mfu}
        for key, value in (("step_s", self.step_s), ("step_cpu_s", self.step_cpu_s)):
            fields[key] = "-" if value is None else f"{value:.4f}"
        fields["threads"] = "-" if self.threads is None else str(self.threads)
        return fields


@dataclass
class StepClock:
    """Wall and process-CPU seconds of each inner step of one round (see the module doc).

    The process's CPU time counts all its threads: torch's OpenMP threads, and also the event
    loop and the state written behind, which are small beside a step and which the median
    leaves out where they bunch up.
    """

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    #: torch's intra-op thread count in the training thread when the steps began.
    threads: int | None = None
    _last: tuple[float, float] | None = None

    def start(self) -> None:
        self.wall, self.cpu = [], []
        self.threads = torch.get_num_threads()
        self._last = (time.perf_counter(), time.process_time())

    def tick(self) -> None:
        """One inner step ended."""
        now = (time.perf_counter(), time.process_time())
        if self._last is not None:
            self.wall.append(now[0] - self._last[0])
            self.cpu.append(now[1] - self._last[1])
        self._last = now


class Meter:
    """Turns (tokens, seconds) of a round's inner steps into a ``Throughput``."""

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        self.flops_per_token = flops_per_token(cfg)
        self.peak = peak_flops(device)
        #: Devices the inner steps run on (a torchrun node's processes): the peak is theirs.
        self.devices = 1

    def measure(
        self, tokens: int, seconds: float, steps: StepClock | None = None
    ) -> Throughput | None:
        """The throughput of ``tokens`` trained in ``seconds`` (with ``steps``' medians, if
        given); None if nothing was timed."""
        if tokens <= 0 or seconds <= 0:
            return None
        rate = tokens / seconds
        mfu = (
            None if self.peak is None else rate * self.flops_per_token / (self.peak * self.devices)
        )
        if steps is None or not steps.wall:
            return Throughput(tokens_per_s=rate, mfu=mfu)
        return Throughput(
            tokens_per_s=rate,
            mfu=mfu,
            step_s=statistics.median(steps.wall),
            step_cpu_s=statistics.median(steps.cpu),
            threads=steps.threads,
        )
