"""Where the inner steps run (``node.compute.placement``) and how fast (``throughput``).

The device path (a copy of the model on the training device, θ copied in and the trained
values copied back to the CPU) is forced on the CPU with ``separate=True``: it must give the
same bytes as training in place, round after round (θ, e, payloads, AdamW), eager overlap's
offset included, and a stopped training must leave θ untouched. ``--device`` is checked before
torch loads, and a CUDA device this machine lacks is a ``DeviceError`` naming what torch sees.
"""

from __future__ import annotations

import threading

import pytest
import torch

from node.compute.model import PRESETS
from node.compute.optim import adam_tensors
from node.compute.placement import Placement, resolve_device
from node.compute.throughput import PEAK_ENV, Meter, flops_per_token, peak_flops
from node.compute.worker import Worker
from node.daemon.settings import check_device_spec, load_settings
from node.errors import Abandoned, DeviceError
from protocol.errors import ConfigError
from protocol.runconfig import RunConfig

RUN = RunConfig(model="llama_tiny", rounds=4, inner_steps=2, batch_size=2, overlap="eager")


def _worker(node: str = "n0", *, separate: bool = False) -> Worker:
    return Worker(
        RUN,
        run_id=RUN.run_id,
        node_id=node,
        slot=0,
        eval_batches=1,
        eval_batch_size=2,
        device="cpu",
        separate=separate,
    )


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype
        and torch.equal(a[n].view(-1).view(torch.uint8), b[n].view(-1).view(torch.uint8))
        for n in a
    )


def test_training_in_a_device_copy_gives_the_bytes_of_training_in_place() -> None:
    in_place, copied = _worker(), _worker(separate=True)
    assert isinstance(in_place.placement, Placement) and isinstance(copied.placement, Placement)
    assert in_place.placement.in_place and not copied.placement.in_place
    assert copied.placement.train_model is not copied.model
    workers = (in_place, copied)
    used_an_offset = False
    for _round in range(3):
        # Eager overlap's start, θ - offset, is computed on the CPU for both.
        offsets = [None if _round == 0 else w.eager_offset(_round - 1) for w in workers]
        used_an_offset |= offsets[1] is not None
        results = [
            w.train_and_compress(w.round, off) for w, off in zip(workers, offsets, strict=True)
        ]
        assert results[0].payload == results[1].payload
        assert results[0].train_loss == results[1].train_loss
        assert _same(in_place.error, copied.error)
        assert _same(in_place.params, copied.params)
        for w, r in zip(workers, results, strict=True):
            w.apply({"n0": w.read(r.payload)})
        assert in_place.fingerprint() == copied.fingerprint()
    assert used_an_offset
    assert _same(adam_tensors(in_place.opt), adam_tensors(copied.opt))
    assert in_place.evaluate() == copied.evaluate()


def test_a_stopped_training_leaves_theta_as_it_was() -> None:
    for separate in (False, True):
        w = _worker(separate=separate)
        before = {n: t.clone() for n, t in w.params.items()}
        fp = w.fingerprint()
        w.stop.set()
        with pytest.raises(Abandoned):
            w.train_and_compress()
        assert _same(w.params, before) and w.fingerprint() == fp
        assert all(not e.any() for e in w.error.values())


def test_each_report_measures_tokens_per_second_and_no_mfu_on_the_cpu(monkeypatch) -> None:
    monkeypatch.delenv(PEAK_ENV, raising=False)
    result = _worker().train_and_compress()
    assert result.throughput is not None
    assert result.throughput.tokens_per_s > 0 and result.throughput.mfu is None
    fields = result.throughput.log_fields()
    assert fields["mfu"] == "-" and float(fields["tokens_per_s"]) > 0


def test_mfu_against_a_peak_from_the_environment(monkeypatch) -> None:
    cfg = PRESETS["llama_1b"]
    # 6 per matrix parameter per token plus attention; the input embedding is a lookup.
    matrices = 0.97e9 - cfg.vocab_size * cfg.d_model
    assert flops_per_token(cfg) == pytest.approx(6 * matrices, rel=0.25)
    monkeypatch.setenv(PEAK_ENV, "1e12")
    assert peak_flops(torch.device("cpu")) == 1e12
    meter = Meter(cfg, torch.device("cpu"))
    speed = meter.measure(tokens=1000, seconds=2.0)
    assert speed is not None and speed.tokens_per_s == 500.0
    assert speed.mfu == pytest.approx(500.0 * flops_per_token(cfg) / 1e12)
    assert meter.measure(tokens=0, seconds=1.0) is None


@pytest.mark.parametrize("spec", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_specs_are_accepted(spec: str) -> None:
    assert check_device_spec(spec) == spec


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:x", "CPU", "mps", ""])
def test_a_bad_device_names_the_flag(spec: str, tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"--device \(or SPARSELOCO_NODE_DEVICE\)"):
        load_settings(coordinator="http://127.0.0.1:1", token="t", state_dir=tmp_path, device=spec)


def test_the_device_comes_from_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SPARSELOCO_NODE_DEVICE", "cpu")
    settings = load_settings(coordinator="http://127.0.0.1:1", token="t", state_dir=tmp_path)
    assert settings.device == "cpu"
    monkeypatch.delenv("SPARSELOCO_NODE_DEVICE")
    settings = load_settings(coordinator="http://127.0.0.1:1", token="t", state_dir=tmp_path)
    assert settings.device == "auto"


def test_auto_and_cpu_resolve_and_a_missing_gpu_is_a_clear_error() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        beyond = f"cuda:{torch.cuda.device_count()}"
        with pytest.raises(DeviceError, match="CUDA device"):
            resolve_device(beyond)
        return
    for spec in ("cuda", "cuda:0", "cuda:3"):
        with pytest.raises(DeviceError, match=r"sees no CUDA device.*--device cpu"):
            resolve_device(spec)
        with pytest.raises(DeviceError):
            Worker(RUN, run_id=RUN.run_id, node_id="n0", slot=0, device=spec)


def test_a_stop_between_steps_on_the_copy_keeps_the_steps_taken() -> None:
    """Stopped after one step on the device copy: AdamW kept that step (local state), θ did not."""
    w = _worker(separate=True)
    w.stop = threading.Event()
    calls = {"n": 0}

    def count() -> None:
        calls["n"] += 1
        w.local_steps += 1
        w.stop.set()

    w._count_step = count  # type: ignore[method-assign]
    with pytest.raises(Abandoned):
        w.train_and_compress()
    assert calls["n"] == 1 and w.local_steps == 1 and adam_tensors(w.opt)


def test_the_console_script_refuses_a_missing_gpu_and_a_bad_device(tmp_path, capsys) -> None:
    from node.cli import main

    node = ["node", "--coordinator", "http://127.0.0.1:9", "--token", "t", "--state-dir"]
    assert main([*node, str(tmp_path), "--device", "gpu"]) == 2
    assert "error: --device (or SPARSELOCO_NODE_DEVICE): 'gpu' is not a device" in (
        capsys.readouterr().err
    )
    assert main(["up", "--device", "cuda:0,tpu"]) == 2
    assert "'tpu' is not a device" in capsys.readouterr().err
    if torch.cuda.is_available():
        return
    for argv in ([*node, str(tmp_path), "--device", "cuda:1"], ["up", "--device", "cpu,cuda"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("sparseloco: error: --device cuda") and "sees no CUDA device" in err
    assert not (tmp_path / "state.safetensors").exists()
