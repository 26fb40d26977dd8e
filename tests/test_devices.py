"""Device names: normalisation at config time, checks before loading, and every place a device
reaches a thread or a kernel call (on this CPU machine, CUDA calls are intercepted and checked
for what the real ones demand: an indexed device)."""
from __future__ import annotations

import pytest
import torch

from harness.infra import devices
from harness.models import loading as models
from harness.job import pipeline as run_mod
from harness.config import ModelConfig, compose, load_model_config
from harness.quant import architectures as adapters


@pytest.mark.parametrize("spec, expected", [
    ("cpu", "cpu"), ("CPU", "cpu"), ("cuda", "cuda:0"), ("cuda:0", "cuda:0"), ("cuda:3", "cuda:3"),
    (" cuda:1 ", "cuda:1"), ("auto", "auto"), ("AUTO", "auto"), ("gpu", "gpu"), ("cuda:x", "cuda:x")])
def test_normalize(spec, expected):
    assert devices.normalize(spec) == expected


@pytest.mark.slow
def test_unindexed_cuda_is_normalised_once_at_config_time():
    cfg = run_mod.to_config(compose(["model=tiny_random", "model.device=cuda"]))
    assert cfg.model.device == "cuda:0"
    assert ModelConfig(name="x", device="cuda").device == "cuda:0"
    indexed = run_mod.to_config(compose(["model=tiny_random", "model.device=cuda:0"]))
    assert run_mod.run_key(cfg) == run_mod.run_key(indexed)  # one spelling, one result and cache identity
    assert load_model_config("llama8b").device == "cuda:0"


def test_the_original_bug_reproduces_on_a_cpu_build():
    """torch.cuda.set_device refuses an unindexed device before any CUDA call."""
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.set_device(torch.device("cuda"))


def test_compute_device_never_returns_unindexed_cuda_or_auto():
    assert devices.compute_device("cuda") == torch.device("cuda", 0)
    assert devices.compute_device(torch.device("cuda")).index == 0
    assert devices.compute_device(torch.device("cuda", 2)).index == 2
    assert devices.compute_device("cpu") == torch.device("cpu")
    with pytest.raises(devices.DeviceError, match="auto"):
        devices.compute_device("auto")


@pytest.fixture
def recorded_set_device(monkeypatch):
    """torch.cuda.set_device replaced by a recorder that enforces the real call's index rule."""
    calls: list[torch.device] = []

    def fake(device):
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if device.type == "cuda" and device.index is None:
            raise ValueError("Expected a torch.device with a specified index or an integer")
        calls.append(device)
    monkeypatch.setattr(torch.cuda, "set_device", fake)
    return calls


def test_set_thread_device(recorded_set_device):
    devices.set_thread_device(torch.device("cuda"))
    devices.set_thread_device("cuda:1")
    devices.set_thread_device("cpu")
    assert recorded_set_device == [torch.device("cuda", 0), torch.device("cuda", 1)]


@pytest.mark.parametrize("device", [torch.device("cuda"), "cuda", "cuda:0"])
def test_staged_forward_threads_select_an_indexed_device(recorded_set_device, device):
    """GPTQ's batch threads: every spelling of the device reaches set_device with an index.

    The block's tensors are on the CPU; only the thread's device selection is CUDA (intercepted)."""
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    hidden = [torch.randn(2, 4), torch.randn(3, 4)]
    seen = []
    outputs = adapters.staged_forward(block, hidden, [((), {}), ((), {})], [block[0], block[1]],
                                      lambda stage, x: seen.append((stage, x.shape)), lambda stage: None, device)
    assert [o.shape for o in outputs] == [(2, 2), (3, 2)]
    assert recorded_set_device == [torch.device("cuda", 0)] * 2
    assert len(seen) == 4


@pytest.mark.slow
def test_calibration_context_device_is_indexed_and_auto_uses_the_embeddings(shared_model_cache, tmp_path):
    cfg = run_mod.to_config(compose(["model=tiny_random", "model.device=cuda", f"paths.cache_dir={tmp_path}"]))
    (tmp_path / "models").symlink_to(shared_model_cache)
    cpu_model = load_model_config("tiny_random")
    loaded = models.load(cpu_model, tmp_path)
    assert run_mod._quant_context(loaded, cfg, None).device == torch.device("cuda", 0)
    cfg.model.device = "auto"
    assert run_mod._quant_context(loaded, cfg, None).device == torch.device("cpu")


def test_check_rejects_absent_and_malformed_devices_on_this_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.check("cpu", torch.float32) == "cpu"
    assert devices.check("auto", torch.bfloat16) == "auto"
    with pytest.raises(devices.DeviceError, match="no CUDA device.*model.device=cpu"):
        devices.check("cuda", torch.float32)
    with pytest.raises(devices.DeviceError, match="cpu, cuda, cuda:N or auto"):
        devices.check("gpu", torch.float32)


def test_check_rejects_a_missing_index_and_bf16_on_an_old_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "Tesla V100")
    assert devices.check("cuda:1", torch.float16) == "cuda:1"
    with pytest.raises(devices.DeviceError, match="sees 2 CUDA device"):
        devices.check("cuda:2", torch.float16)
    with pytest.raises(devices.DeviceError, match="bfloat16 needs a GPU of compute capability 8.0.*V100"):
        devices.check("cuda", torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (9, 0))
    assert devices.check("cuda", torch.bfloat16) == "cuda:0"


def test_bad_device_fails_before_the_model_is_built(monkeypatch, tmp_path):
    def never(*args, **kwargs):
        raise AssertionError("the model was built before the device was checked")
    monkeypatch.setattr(models, "build_tiny_random", never)
    cfg = load_model_config("tiny_random")
    cfg.device = "cuda:7"
    with pytest.raises(models.ModelLoadError, match="cuda:7"):
        models.load(cfg, tmp_path)
    cfg.device, cfg.max_memory = "cpu", {"cpu": "1GiB"}
    with pytest.raises(models.ModelLoadError, match="only applies to model.device=auto"):
        models.load(cfg, tmp_path)


@pytest.mark.parametrize("raw, parsed", [
    ({"0": "70GiB", "gpu1": "70GiB", "cuda2": "1GiB", "cpu": "200GiB", "disk": "1TiB"},
     {0: "70GiB", 1: "70GiB", 2: "1GiB", "cpu": "200GiB", "disk": "1TiB"}),
    ({}, None)])
def test_parse_max_memory(raw, parsed):
    assert devices.parse_max_memory(raw) == parsed


def test_parse_max_memory_rejects_unknown_keys():
    with pytest.raises(devices.DeviceError, match="gpu0, cuda0"):
        devices.parse_max_memory({"tpu": "1GiB"})


def test_max_memory_composes_from_the_command_line():
    cfg = run_mod.to_config(compose(["model=tiny_random", "model.device=auto",
                                     "+model.max_memory={gpu0: 1GiB, cpu: 2GiB}"]))
    assert devices.parse_max_memory(cfg.model.max_memory) == {0: "1GiB", "cpu": "2GiB"}
