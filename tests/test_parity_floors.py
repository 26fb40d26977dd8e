"""Parity with both floors: the scheme's own floor (its simulation against itself with the input embeddings moved in
the last bit, harness.quant.perturb) beside the engine-noise floor, and the flag against the larger of the two.

The chaotic case is built from real arithmetic, not from numbers: a small random llama (hidden 512, 4 blocks) whose
linears take dynamic per-token FP8 activations (the fp8 scheme). Its greedy next tokens over 48 sequences are
"replies"; the served stand-in is the same simulation under another last-bit perturbation (an engine whose sums
differ in the last bit), and the engine floor the unquantized model against itself under that perturbation. Every
disagreement count is made here, from the tokens, not by the module's code.
"""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from harness import quant
from harness.compare.parity_table import ParityInputs, headline, parity_markdown, parity_table
from harness.compare.sources import RunData
from harness.config import compose, to_config
from harness.job import parity_runs as parity_cli
from harness.models import loading
from harness.quant.perturb import perturb_embeddings, ulp_perturbed

SHAPE = ["model=tiny_random", "model.tiny.hidden_size=512", "model.tiny.intermediate_size=1024",
         "model.tiny.num_hidden_layers=4", "model.tiny.vocab_size=1024"]


def _signs_by_hand(ids: list[int], hidden: int, seed: int) -> np.ndarray:
    """The documented sign pattern, computed with Python integers (a second implementation)."""
    out = np.empty((len(ids), hidden))
    for row, token in enumerate(ids):
        for j in range(hidden):
            h = (token * hidden + j + (seed + 1) * 0x5BD1E995) & 0xFFFFFFFF
            h = (h * 0x9E3779B1) & 0xFFFFFFFF
            h ^= h >> 16
            h = (h * 0x9E3779B1) & 0xFFFFFFFF
            out[row, j] = 1.0 if h >> 31 else -1.0
    return out


@pytest.fixture(scope="module")
def small():
    torch.set_num_threads(1)
    cfg = to_config(compose([*SHAPE[:1], "model.tiny.vocab_size=1024", "quant=fp8"]))
    return loading.load(cfg.model, cfg.paths.cache_dir).model


def test_the_hook_moves_each_embedding_entry_by_one_part_in_2_23(small):
    ids = torch.tensor([[5, 17, 900, 3, 17]])
    embeds = small.get_input_embeddings()(ids)
    signs = torch.tensor(_signs_by_hand(ids[0].tolist(), embeds.shape[-1], seed=0), dtype=torch.float32)
    by_hand = embeds * (1 + signs * 2.0 ** -23)
    assert torch.equal(ulp_perturbed(ids, embeds, 0), by_hand)
    moved = (by_hand != embeds).float().mean().item()
    assert 0.3 < moved <= 1.0  # x(1 ± 2^-23) rounds back to x for some entries
    relative = ((by_hand - embeds).abs() / embeds.abs().clamp_min(1e-30)).max().item()
    assert relative <= 2.0 ** -22
    # the same token gets the same pattern wherever it stands (so the batch an item is answered in does not matter)
    assert torch.equal(by_hand[0, 1], by_hand[0, 4])
    with torch.no_grad():
        plain = small(ids).logits
        handle = perturb_embeddings(small, 0)
        hooked = small(ids).logits
        handle.remove()
        direct = small(inputs_embeds=by_hand).logits
    assert torch.equal(hooked, direct) and not torch.equal(hooked, plain)


def test_the_ulp_method_quantizes_as_its_base_and_then_perturbs():
    torch.set_num_threads(1)
    base = to_config(compose([*SHAPE[:1], "model.tiny.vocab_size=1024", "quant=fp8"]))
    twin_overrides = parity_cli.scheme_floor_overrides([*SHAPE[:1], "model.tiny.vocab_size=1024", "quant=fp8"],
                                                       base.quant)
    twin = to_config(compose(twin_overrides))
    assert twin.quant.method == "rtn_ulp" and twin.quant.name == "fp8_ulp"
    assert "harness.quant.perturb" in twin.quant.plugins
    models = []
    for cfg in (base, twin):
        model = loading.load(cfg.model, cfg.paths.cache_dir).model
        report = quant.apply(model, cfg.quant, None)
        models.append(model)
    assert any("last place" in note for note in report.notes)
    weights = [dict(m.named_parameters()) for m in models]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])  # same weights
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        handle = perturb_embeddings(models[0], 0)
        expected = models[0](ids).logits
        handle.remove()
        assert torch.equal(models[1](ids).logits, expected)  # the twin is the base with the hook, nothing else
    from harness.job.identity import run_key
    assert run_key(base) != run_key(twin)


def _replies(model: torch.nn.Module, ids: torch.Tensor, seed: int | None) -> list[str]:
    """Greedy next token at each of the last 16 positions, per sequence, as one reply string."""
    handle = perturb_embeddings(model, seed) if seed is not None else None
    try:
        with torch.no_grad():
            tokens = model(ids).logits[:, -16:].argmax(-1)
    finally:
        if handle is not None:
            handle.remove()
    return [" ".join(map(str, row)) for row in tokens.tolist()]


def _run(name: str, ref: list[str], quant_replies: list[str], target: list[str]) -> RunData:
    n = len(ref)
    items = pd.DataFrame({
        "item_id": [f"i{k}" for k in range(n)], "slice": "toy", "sub_slice": "all", "cluster": [f"c{k}" for k in range(n)],
        "output_type": "generate_until", "target": target,
        "correct_ref": [float(r.split()[0] == t) for r, t in zip(ref, target)],
        "correct_quant": [float(q.split()[0] == t) for q, t in zip(quant_replies, target)],
        "response_ref": ref, "response_quant": quant_replies})
    return RunData(run_id=None, summary={"model": "tiny", "scheme": name, "metrics": {}}, items=items,
                   tokens=pd.DataFrame(), generation=pd.DataFrame(), source=name)


@pytest.fixture(scope="module")
def chaotic():
    """Replies of the FP8 simulation, its last-bit twin, the served stand-in, and the reference with its own twin."""
    torch.set_num_threads(1)
    ids = torch.randint(0, 1024, (48, 48), generator=torch.Generator().manual_seed(0))
    replies = {}
    for scheme in ("none", "fp8"):
        cfg = to_config(compose([*SHAPE, f"quant={scheme}"]))
        model = loading.load(cfg.model, cfg.paths.cache_dir).model
        if scheme != "none":
            quant.apply(model, cfg.quant, None)
        replies[scheme] = {seed: _replies(model, ids, seed) for seed in (None, 0, 1)}
    return replies


def test_a_chaotic_scheme_gets_its_own_floor_and_is_not_flagged_where_the_engine_floor_alone_would(chaotic):
    ref, fp8 = chaotic["none"], chaotic["fp8"]
    target = [r.split()[0] for r in ref[None]]  # the reference's first greedy token is "right"
    simulation = _run("fp8", ref[None], fp8[None], target)
    own = _run("fp8_ulp", ref[None], fp8[0], target)
    served = _run("external:fp8-served", ref[None], fp8[1], target)  # an engine off in the last bit
    floor = _run("external:reference-served", ref[None], ref[1], target)
    n = len(target)
    differ_served = sum(a != b for a, b in zip(fp8[None], fp8[1]))
    differ_own = sum(a != b for a, b in zip(fp8[None], fp8[0]))
    differ_engine = sum(a != b for a, b in zip(ref[None], ref[1]))
    assert differ_engine == 0  # the unquantized model does not notice a last-bit change here
    assert differ_own >= n // 4 and differ_served >= n // 4  # FP8 dynamic activations do, on many items

    engine_only = parity_table(ParityInputs(simulation, served, floor)).set_index("slice").loc["overall"]
    assert engine_only["exceeds_floor"] and engine_only["binding_floor"] == "engine"

    both = parity_table(ParityInputs(simulation, served, floor, own)).set_index("slice").loc["overall"]
    assert both["disagree_own_floor"] == pytest.approx(differ_own / n)
    assert both["disagree_floor"] == pytest.approx(differ_engine / n)
    assert both["disagree_sim_served"] == pytest.approx(differ_served / n)
    assert both["binding_floor"] == "scheme"
    assert both["excess"] == pytest.approx((differ_own - differ_served) / n)
    assert not both["exceeds_floor"]
    lines = headline(parity_table(ParityInputs(simulation, served, floor, own)))
    assert lines[0].startswith("quality: Δ accuracy served − simulated")
    assert f"scheme's own floor {differ_own}/{n}" in lines[1] and "not shown beyond the larger floor" in lines[1]


def _hand_runs(n: int = 300, seed: int = 3):
    """Simulation, served, engine floor and own floor with answers moved on chosen shares of items."""
    rng = np.random.default_rng(seed)
    answer = rng.integers(0, 4, n)

    def moved(share: float, base: np.ndarray, salt: int) -> np.ndarray:
        flip = np.random.default_rng(seed + salt).random(n) < share
        return np.where(flip, (base + 1) % 4, base)

    def run(name, ref, got, metrics=None):
        return RunData(run_id=None, summary={"model": "m", "scheme": name, "metrics": metrics or {}},
                       items=pd.DataFrame({"item_id": [f"i{k}" for k in range(n)], "slice": "math", "sub_slice": "all",
                                           "cluster": [f"c{k // 3}" for k in range(n)], "output_type": "generate_until",
                                           "target": "0", "correct_ref": (ref == 0).astype(float),
                                           "correct_quant": (got == 0).astype(float), "response_ref": ref.astype(str),
                                           "response_quant": got.astype(str)}),
                       tokens=pd.DataFrame(), generation=pd.DataFrame(), source=name)

    sim_answers = moved(0.1, answer, 1)
    return (run("fp8", answer, sim_answers, {"overall/kl_mean": 0.03}),
            run("served", answer, moved(0.3, sim_answers, 2), {"overall/kl_lower_bound_mean": 0.025}),
            run("floor", answer, moved(0.02, answer, 3)), run("fp8_ulp", answer, moved(0.1, sim_answers, 4)))


def test_both_floors_equal_a_hand_count_and_the_flag_needs_to_exceed_both():
    sim, served, floor, own = _hand_runs()
    row = parity_table(ParityInputs(sim, served, floor, own)).set_index("slice").loc["overall"]
    s, v = sim.items["response_quant"], served.items["response_quant"]
    agree = (s == v).mean()
    agree_engine = (floor.items["response_ref"] == floor.items["response_quant"]).mean()
    agree_own = (s == own.items["response_quant"]).mean()
    assert row["excess_engine"] == pytest.approx(agree - agree_engine)
    assert row["excess_own"] == pytest.approx(agree - agree_own)
    assert row["binding_floor"] == ("scheme" if agree_own < agree_engine else "engine")
    assert row["exceeds_floor"] == (row["excess_engine_ci_high"] < 0 and row["excess_own_ci_high"] < 0)
    assert row["exceeds_floor"]  # 30 % against floors of 2 % and 10 % on 300 items
    assert row["verdict"] and row["margin"] == 0.02
    assert row["kl_check"].startswith("consistent")  # 0.025 bound below the simulation's 0.03
    table = parity_markdown(parity_table(ParityInputs(sim, served, floor, own)))
    assert "scheme floor %" in table and "EXCEEDS FLOOR" in table and "≥ 0.0250" in table


def _write(directory, run: RunData) -> str:
    directory.mkdir()
    (directory / "summary.json").write_text(json.dumps(run.summary))
    run.items.to_parquet(directory / "items.parquet", index=False)
    return str(directory)


def test_command_reads_the_own_floor_run(tmp_path, capsys):
    runs = _hand_runs()
    dirs = [_write(tmp_path / name, run) for name, run in zip(("sim", "served", "floor", "own"), runs)]
    out = tmp_path / "parity"
    code = parity_cli.main([f"simulation={dirs[0]}", f"served={dirs[1]}", f"floor={dirs[2]}", f"own_floor={dirs[3]}",
                            f"out={out}", "log=false", "margin=0.05"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "scheme's own floor" in printed and "quality: Δ accuracy" in printed
    written = json.loads((out / "parity.json").read_text())
    assert written["own_floor"] == dirs[3] and written["margin"] == 0.05
    assert written["headline"][0].startswith("quality:")
    assert parity_cli.main([f"simulation={dirs[0]}", f"served={dirs[1]}", "speed=true", "log=false"]) == 2
