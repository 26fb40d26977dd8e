"""A prompt log's production replies as the reference's (``prompts.reference_replies=true``): rows that logged a
``reference_reply`` are not generated on the reference side; the logged reply is cut at the row's token cap (counted
here with the tokenizer, independently of the harness) and paired with the candidate's reply like a generated one;
rows without one are generated as before; the option is part of the run's key."""
from __future__ import annotations

import json

import pandas as pd

from harness.config import to_config
from harness.job import pipeline as run_mod
from harness.models import loading as models

LOGGED = {0: "Open Settings, then Security, then choose Reset password and follow the link we email you. " * 3,
          2: "Short answer."}


def _log(path):
    rows = [{"id": f"r{i}", "group": f"user-{i // 2}", "max_tokens": 8,
             "messages": [{"role": "user", "content": f"Question {i}: how do I reset my password?"}],
             **({"reference_reply": LOGGED[i]} if i in LOGGED else {})} for i in range(6)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_logged_replies_stand_for_the_references_own_and_are_cut_at_the_rows_cap(make_cfg, tmp_path):
    log = _log(tmp_path / "log.jsonl")
    common = ["model=tiny_random", "quant=int8", "slices=prompts", f"prompts.path={log}", "compare.n_resamples=200",
              "tracking.enabled=false"]
    replayed = run_mod.run(make_cfg(*common, "prompts.reference_replies=true"))
    generated = run_mod.run(make_cfg(*common))
    assert replayed["run_key"] != generated["run_key"]
    cfg = to_config(make_cfg(*common))
    tokenizer = models.load(cfg.model, cfg.paths.cache_dir).tokenizer
    results = {s["run_key"]: d for d in (tmp_path / "results").iterdir()
               if (s := json.loads((d / "summary.json").read_text()))}
    items = pd.read_parquet(results[replayed["run_key"]] / "items.parquet").set_index("item_id")
    own = pd.read_parquet(results[generated["run_key"]] / "items.parquet").set_index("item_id")
    for i in range(6):
        reply = items.loc[f"harness_prompts/r{i}", "response_ref"]
        if i in LOGGED:
            ids = tokenizer(LOGGED[i], add_special_tokens=False)["input_ids"]
            expected = tokenizer.decode(ids[:8]) if len(ids) > 8 else LOGGED[i]
            assert reply == expected
        else:  # generated, as the run without the option generated it
            assert reply == own.loc[f"harness_prompts/r{i}", "response_ref"]
    # the candidate answers as it does without the option: only the reference side changed
    assert (items["response_quant"] == own.loc[items.index, "response_quant"]).all()
    # the long logged reply reached the cap, the short one did not
    outcomes = pd.read_parquet(results[replayed["run_key"]] / "prompt_outcomes.parquet").set_index("item_id")
    assert bool(outcomes.loc["harness_prompts/r0", "cap_hit_ref"]) and not bool(outcomes.loc["harness_prompts/r2", "cap_hit_ref"])
