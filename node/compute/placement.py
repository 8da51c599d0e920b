"""Where a node's inner steps run: in place on θ's own model (the CPU), or on a copy on a device.

The design rule: θ (the parameters between rounds), the error-feedback buffer, compression and
aggregation stay on the CPU in fp32 on every node, whatever its device, so GPU and CPU nodes of
one run hold bit-identical θ after every round; only the H inner steps (local training, which
differs per node anyway) run on the device. Two ways, one interface (``begin``, ``finish``,
``abandon``):

- **in place** (the CPU, the default): the worker's model is trained itself. Its parameters are
  handed a copy of θ_r (or θ_r - offset), θ_r's own memory is handed back afterwards and the
  pseudo-gradient θ_r - θ_trained is computed into the memory training used: one copy of θ a
  round, and the bytes of every round exactly as before devices existed.
- **on a device** (CUDA; or the CPU with ``separate``, which the tests use to check this path
  against the other): a second model lives on the device with its own AdamW (fused on CUDA).
  θ_r (or θ_r - offset, computed on the CPU) is copied into it, H steps run there (bf16 autocast
  on CUDA), and the trained parameters come back into fresh CPU memory, where the
  pseudo-gradient is the same fp32 subtraction as in place.

Evaluation runs on the training device too (θ copied in first): a 1 B model evaluated on a CPU
would take longer than the round. The loss it reports is a measurement, not shared state.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping

import torch

from node.compute.model import LanguageModel, evaluate
from node.errors import DeviceError


def resolve_device(spec: str | torch.device) -> torch.device:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` as a torch device on this machine.

    ``auto`` is ``cuda:0`` when torch sees a GPU, else the CPU. A CUDA device that is not there
    (a CPU build of torch, no GPU visible, an index past the last GPU) raises ``DeviceError``
    saying what torch does see.
    """
    if isinstance(spec, torch.device):
        spec = str(spec)
    if spec == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError as exc:
        raise DeviceError(f"--device {spec!r}: {exc}; give auto, cpu or cuda:N") from exc
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise DeviceError(f"--device {spec!r}: only cpu and cuda devices are supported")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise DeviceError(
            f"--device {spec}: torch {torch.__version__} ({build}) sees no CUDA device on this"
            " machine; use --device cpu (or auto), or install a CUDA build of torch"
        )
    index = 0 if device.index is None else device.index
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(
            f"--device {spec}: torch sees {count} CUDA device(s) (cuda:0 to cuda:{count - 1})"
        )
    return torch.device("cuda", index)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.data for n, p in model.named_parameters()}


class Placement:
    """The model the inner steps train, and how θ gets there and the trained values back."""

    def __init__(
        self, model: LanguageModel, device: torch.device, *, separate: bool = False
    ) -> None:
        #: The worker's model: its parameters are θ, on the CPU.
        self.model = model
        self.device = device
        self.in_place = device.type == "cpu" and not separate
        #: The model the inner steps run on (``model`` itself when in place).
        self.train_model = model if self.in_place else copy.deepcopy(model).to(device)
        #: (in place) θ_r's memory while training works on its copy.
        self._start: dict[str, torch.Tensor] | None = None

    def begin(self, offset: Mapping[str, torch.Tensor] | None = None) -> None:
        """Put θ (minus ``offset``, if given) into the model training will run on."""
        with torch.no_grad():
            if self.in_place:
                self._start = _params(self.model)
                for n, p in self.model.named_parameters():
                    p.data = p.data.clone() if offset is None else torch.sub(p.data, offset[n])
                return
            self._load(offset)

    def theta(self) -> dict[str, torch.Tensor]:
        """θ's own tensors, also while training works on its copy (in place)."""
        return dict(self._start) if self._start is not None else _params(self.model)

    def shift(self, step: Mapping[str, torch.Tensor]) -> None:
        """(overlap "merge", between inner steps) Subtract ``step`` (θ_old - θ_new, the outer
        step just applied to θ) from the parameters being trained; AdamW's moments stay."""
        model = self.model if self.in_place else self.train_model
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.data.sub_(step[n].to(p.device))

    def _load(self, offset: Mapping[str, torch.Tensor] | None = None) -> None:
        theta = _params(self.model)
        with torch.no_grad():
            for n, p in self.train_model.named_parameters():
                p.copy_(theta[n] if offset is None else torch.sub(theta[n], offset[n]))

    def finish(self) -> dict[str, torch.Tensor]:
        """The pseudo-gradient ``θ - θ_trained`` on the CPU (fresh memory or training's own);
        θ is θ again afterwards, bit for bit."""
        delta = {}
        with torch.no_grad():
            if self.in_place:
                start, self._start = self._start, None
                if start is None:
                    raise RuntimeError("finish() without begin()")
                for name, p in self.model.named_parameters():
                    trained = p.data
                    p.data = start[name]
                    delta[name] = torch.sub(start[name], trained, out=trained)
                return delta
            theta = _params(self.model)
            for name, p in self.train_model.named_parameters():
                trained = p.detach().to("cpu", copy=True)
                delta[name] = torch.sub(theta[name], trained, out=trained)
        return delta

    def abandon(self) -> None:
        """Training stopped part-way: θ's memory goes back (in place); the copy is scratch."""
        start, self._start = self._start, None
        if self.in_place and start is not None:
            for name, p in self.model.named_parameters():
                p.data = start[name]

    def synchronize(self) -> None:
        """Wait for the device's queued work (so a timing of the inner steps is whole)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """The held-out loss of θ, on the training device."""
        if self.in_place:
            return evaluate(self.model, batches)
        self._load()
        return evaluate(self.train_model, batches)
