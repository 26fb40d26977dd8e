"""harness.planning.plan's rates from earlier runs' measured throughput (summary.json ``throughput``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.planning import plan as plan_mod
from harness.cli import compose_run

PREFILL, DECODE = 1200.0, 40.0  # the rates the synthetic runs were "measured" at


def write_run(root: Path, name: str, *, model: str = "tiny_random", dtype: str = "float32", device: str = "cpu",
              gpu: str | None = None, load: float = 3.0) -> None:
    stages = {"reference": (5000, 300), "evaluate": (4000, 250), "divergence": (900, 0), "quantize": (2000, 0)}
    throughput = {s: {"prefill_tokens": p, "generated_tokens": g, "seconds": p / PREFILL + g / DECODE,
                      "tokens_per_s": 0.0} for s, (p, g) in stages.items()}
    machine = {"cpus": "2", **({"gpu": gpu} if gpu else {})}
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "summary.json").write_text(json.dumps({"run_key": name, "model": model, "throughput": throughput,
                                                        "machine": machine, "timings": {"load": load}}))
    (directory / "config.json").write_text(json.dumps({"model": {"dtype": dtype, "device": device}}))


def test_rates_are_fitted_to_matching_runs_only(tmp_path):
    cfg = compose_run(["model=tiny_random"])
    results = tmp_path / "results"
    write_run(results, "a", load=2.0)
    write_run(results, "b", load=4.0)
    write_run(results, "c", dtype="bfloat16", load=100.0)  # other dtype, other hardware, other model: ignored
    write_run(results, "d", gpu="NVIDIA H200", load=100.0)
    write_run(results, "e", model="smollm2_135m", load=100.0)
    (results / "f").mkdir()
    (results / "f" / "summary.json").write_text("{not json")  # an unreadable run is skipped
    rate = plan_mod.throughput_from_results(results, cfg.model, "CPU (2 cores)")
    assert rate.prefill_tokens_per_s == pytest.approx(PREFILL, rel=1e-9)
    assert rate.decode_tokens_per_s == pytest.approx(DECODE, rel=1e-9)
    assert rate.load_s == pytest.approx(3.0)
    assert "8 stages of 2 earlier run(s)" in rate.source and "CPU (2 cores)" in rate.source
    gpu = plan_mod.throughput_from_results(results, cfg.model, "NVIDIA H200")
    assert gpu.load_s == 100.0 and "1 earlier run(s)" in gpu.source
    assert plan_mod.throughput_from_results(results, cfg.model, "NVIDIA A100") is None
    assert plan_mod.throughput_from_results(tmp_path / "absent", cfg.model, "CPU (2 cores)") is None


def test_runs_without_generation_cannot_give_a_decode_rate(tmp_path):
    cfg = compose_run(["model=tiny_random"])
    write_run(tmp_path, "a")
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    for stage in summary["throughput"].values():
        stage["seconds"] -= stage["generated_tokens"] / DECODE
        stage["generated_tokens"] = 0
    (tmp_path / "a" / "summary.json").write_text(json.dumps(summary))
    assert plan_mod.throughput_from_results(tmp_path, cfg.model, "CPU (2 cores)") is None


@pytest.mark.slow
def test_plan_sweep_uses_a_finished_runs_throughput(make_cfg, tmp_path, cache_dir, capsys):
    """A real run's summary.json, its stage times set to known rates: the plan must estimate with those."""
    from harness.job import pipeline as run_mod
    from tests.test_sweeps import TINY, paths

    run_mod.run(make_cfg(*TINY, "quant=int8", "tracking.enabled=false"))
    [path] = (tmp_path / "results").glob("*/summary.json")
    summary = json.loads(path.read_text())
    assert summary["throughput"]["evaluate"]["generated_tokens"] > 0
    for stage in summary["throughput"].values():
        stage["seconds"] = stage["prefill_tokens"] / PREFILL + stage["generated_tokens"] / DECODE
    path.write_text(json.dumps(summary))
    plan = plan_mod.plan_sweep([*TINY, *paths(tmp_path, cache_dir), "quant=int4"])
    [rate] = plan.throughput.values()
    assert (rate.prefill_tokens_per_s, rate.decode_tokens_per_s) == (pytest.approx(PREFILL), pytest.approx(DECODE))
    assert rate.load_s == pytest.approx(summary["timings"]["load"])
    assert "1 earlier run(s)" in rate.source
    assert plan_mod.main([*TINY, *paths(tmp_path, cache_dir), "quant=int4"]) == 0
    assert "1 earlier run(s) in" in capsys.readouterr().out


LLAMA8B_PARAMS = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096) + 2 * 128256 * 4096 + 65 * 4096


@pytest.mark.slow
def test_a_gpu_sweep_is_planned_on_a_machine_without_cuda_or_hub_loading_nothing(monkeypatch, tmp_path, cache_dir):
    """model=llama8b (device cuda) on a login node: shapes from the packaged table or a local config.json, rates a
    roofline for the GPU named, tokens with the stand-in tokenizer; no weights are loaded, and the plan says so."""
    import json

    from harness.models import loading as models

    monkeypatch.setattr(plan_mod.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("the plan loaded a model"))
    local = tmp_path / "llama"  # a local copy holding only config.json: no tokenizer, no weights
    local.mkdir()
    (local / "config.json").write_text(json.dumps({
        "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False}))
    common = ["model=llama8b", "slices=[math]", "slices.math.n_items=6", f"paths.cache_dir={cache_dir}",
              f"paths.results_dir={tmp_path / 'results'}"]
    real_tokenizer = plan_mod._tokenizer_for

    def unreachable_hub(model, cache):
        if model.name == "llama8b" and model.path == "meta-llama/Llama-3.1-8B-Instruct":
            raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")  # as offline
        return real_tokenizer(model, cache)

    monkeypatch.setattr(plan_mod, "_tokenizer_for", unreachable_hub)
    for extra in ([], [f"model.path={local}"]):  # the packaged table's shapes, then the local config.json's
        plan = plan_mod.plan_sweep([*common, *extra, "quant=int4_g128,fp8"], gpu="H200")
        [rate] = plan.throughput.values()
        assert rate.prefill_tokens_per_s == pytest.approx(989e12 / (2 * LLAMA8B_PARAMS), rel=1e-12)
        read = LLAMA8B_PARAMS * 2 - 128255 * 4096 * 2  # bf16 weights, one embedding row gathered per step
        assert rate.decode_tokens_per_s == pytest.approx(16 * 4.8e12 / read, rel=1e-12)  # batch_size 16
        assert "roofline for one H200" in rate.source and "lower bounds" in rate.source
        assert len(plan.jobs) == 2 and plan.jobs[0].status == "not checked"
        assert sum(s.requests for s in plan.jobs[0].slices) > 0
        assert any("smollm2_135m's tokenizer" in note for note in plan.notes)
        assert not any("eval.sequential" in note for note in plan.notes)
    sequential = plan_mod.plan_sweep([*common, "quant=int4_g128,fp8", "eval.sequential=true,false"], gpu="H200")
    [note] = [note for note in sequential.notes if "eval.sequential" in note]
    assert "(job 0, 2)" in note and "upper bound" in note  # the two sequential jobs of four, named
    with pytest.raises(plan_mod.cli.UsageError, match="unknown GPU 'H900'"):
        plan_mod.plan_sweep(common, gpu="H900")


def test_a_model_larger_than_one_gpu_is_planned_with_a_note(monkeypatch, cache_dir):
    from harness.sizing import ledger

    monkeypatch.setattr(plan_mod.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(plan_mod, "_tokenizer_for", lambda model, cache: object())  # the tokenizer is not the point
    cfg = compose_run(["model=llama70b", f"paths.cache_dir={cache_dir}"])  # device=auto, 141 GB of bf16 weights
    (h100,) = ledger.resolve_gpus(["H100"])
    model = plan_mod._prepare_model(cfg, None, None, h100)
    assert model.loaded is None and "roofline for one H100" in model.throughput.source
    assert "141.1 GB of bfloat16 weights do not fit one H100 (85.5 GB)" in model.note
