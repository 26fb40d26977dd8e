"""Calibrated-weight cache I/O: written one decoder block at a time, read one tensor at a time."""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch

from harness.infra.cache import Cache
from harness.quant import calibrated_cache as cc
from harness.quant import QuantReport
from tiny_models import tiny_llama


llama = partial(tiny_llama, hidden_size=32, layers=3)


NAMES = [f"model.layers.{i}.{n}.weight" for i in range(3) for n in ("self_attn.q_proj", "mlp.down_proj")]
NAMES += ["model.layers.1.input_layernorm.weight", "lm_head.weight"]



def test_round_trip_is_exact_and_sharded_by_block(tmp_path: Path, monkeypatch) -> None:
    from safetensors import torch as st
    written: list[int] = []
    real_save = st.save_file

    def recording(tensors, path, *args, **kwargs):
        written.append(sum(t.numel() * t.element_size() for t in tensors.values()))
        return real_save(tensors, path, *args, **kwargs)
    monkeypatch.setattr(st, "save_file", recording)
    source, target = llama(seed=0), llama(seed=1)
    cache = Cache(tmp_path)
    cc._store(source, NAMES, [], cache, "k")
    directory = cache.entry(cc.NAMESPACE, "k")
    index = json.loads((directory / "shards.json").read_text())
    assert len(index) == 4  # layers 0, 1, 2 and lm_head, each its own file
    assert sorted(n for members in index.values() for n in members) == sorted(NAMES)
    params = dict(source.named_parameters())
    block_bytes = max(sum(params[n].numel() * 4 for n in members) for members in index.values())
    total = sum(params[n].numel() * 4 for n in NAMES)
    assert max(written) == block_bytes < total  # never more than one shard in host memory
    cc._load(target, directory, QuantReport(scheme="s", method="gptq", total_params=0))
    changed = dict(target.named_parameters())
    for name, value in source.named_parameters():
        if name in NAMES:
            assert torch.equal(changed[name], value), name
        elif value.dim() == 2:  # untouched weights stay the target's (norms are all ones in both)
            assert not torch.equal(changed[name], value), name


def test_a_single_file_entry_of_the_older_layout_still_loads(tmp_path: Path) -> None:
    from safetensors.torch import save_file
    source, target = llama(seed=0), llama(seed=1)
    directory = tmp_path / "entry"
    directory.mkdir()
    params = dict(source.named_parameters())
    save_file({n: params[n].contiguous() for n in NAMES}, str(directory / "weights.safetensors"))
    (directory / "report.json").write_text("[]")
    cc._load(target, directory, QuantReport(scheme="s", method="gptq", total_params=0))
    assert all(torch.equal(dict(target.named_parameters())[n], params[n]) for n in NAMES)


def test_an_entry_of_another_model_is_refused(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    cc._store(llama(seed=0), NAMES, [], cache, "k")
    other = llama(hidden_size=48, intermediate_size=64, seed=None)
    with pytest.raises(RuntimeError, match="does not match this model.*delete the entry"):
        cc._load(other, cache.entry(cc.NAMESPACE, "k"),
                 QuantReport(scheme="s", method="gptq", total_params=0))
