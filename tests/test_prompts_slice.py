"""The prompts slice: your prompt log judged without gold answers (slices/prompts/, harness.results.prompt_outcomes).

Per-reply checks are compared with replies written to have them; the paired metrics with counts taken directly
from the table; a planted change (refusals added to the candidate's replies) must be found, and no change must not
be; a whole tiny job from a log with a planted marker must keep the marker out of MLflow, the console and the job
log unless ``prompts.log_text=true``.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.config import SLICES_DIR
from harness.evaluation import prompt_log
from harness.evaluation.slices import import_slice_module
from harness.results import prompt_outcomes
from harness.results.tracking import private_slices, redacted_items

REPO = Path(__file__).resolve().parents[1]
MARKER = "ZQX-PLANTED-7731"


def _tokenize(text: str) -> list[int]:
    return [ord(c) for c in text]


def _items(replies: list[tuple[str, str]], clusters: list[str] | None = None) -> pd.DataFrame:
    n = len(replies)
    return pd.DataFrame({"item_id": [f"harness_prompts/r{i}" for i in range(n)], "slice": "prompts",
                         "sub_slice": "all", "stratum": "all",
                         "cluster": clusters or [f"g{i}" for i in range(n)],
                         "response_ref": [r for r, _ in replies], "response_quant": [q for _, q in replies]})


def test_each_reply_check_reads_what_the_reply_holds():
    fenced = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\n"
    broken = "```python\ndef add(a, b)\n    return a +\n```"
    assert prompt_outcomes.reply_checks(fenced)["code"] == 1
    assert prompt_outcomes.reply_checks(broken)["code"] == 0
    assert prompt_outcomes.reply_checks('{"name": "Ada", "total": 12.5}')["json"] == 1
    assert prompt_outcomes.reply_checks('{"name": "Ada", total: }')["json"] == 0
    assert prompt_outcomes.reply_checks("I'm sorry, but I can't help with that request.")["refused"] == 1
    assert prompt_outcomes.reply_checks("Sure! Restart the router, then sign in again.")["refused"] == 0
    assert prompt_outcomes.reply_checks("  \n")["empty"] == 1
    assert prompt_outcomes.reply_checks("the end " * 20)["loop"] == 1


@pytest.mark.parametrize("language,text", [
    ("en", "Could you tell me when my order will arrive? I placed it last Tuesday."),
    ("fr", "Pouvez-vous me dire quand ma commande arrivera ? Je l'ai passée mardi dernier."),
    ("de", "Können Sie mir sagen, wann meine Bestellung ankommt? Ich habe sie letzten Dienstag aufgegeben."),
    ("es", "¿Puede decirme cuándo llegará mi pedido? Lo hice el martes pasado."),
    ("it", "Può dirmi quando arriverà il mio ordine? L'ho fatto martedì scorso."),
    ("pt", "Pode dizer-me quando chega a minha encomenda? Fiz o pedido na terça-feira passada."),
    ("zh", "请问我的订单什么时候能到？我是上周二下的单，现在还没有收到任何消息。"),
    ("ja", "注文した商品はいつ届きますか？先週の火曜日に注文しましたが、まだ連絡がありません。"),
])
def test_the_language_of_a_reply_is_the_language_it_is_written_in(language, text):
    assert prompt_outcomes.language_of(text) == language
    assert prompt_outcomes.language_of("42") == ""  # too few letters to have a language


def test_outcome_frame_pairs_the_two_replies_and_the_cap_of_each_row():
    replies = [("Same reply here.", "Same reply here."),
               ('{"a": 1}', "Sorry, I can't help with that."),
               ("Voici la réponse complète à votre question sur la facture.", "Here is the full answer to your bill.")]
    items = _items(replies)
    rows = {"harness_prompts/r0": {"max_tokens": 16, "messages_json": json.dumps([{"role": "user", "content": "Hi"}])},
            "harness_prompts/r1": {"max_tokens": 8, "messages_json": "[]"},
            "harness_prompts/r2": {"max_tokens": 0, "messages_json": json.dumps(
                [{"role": "user", "content": "Bonjour, pouvez-vous m'expliquer ma facture de ce mois-ci ?"}])}}
    frame = prompt_outcomes.outcome_frame(items, rows, _tokenize, cap_override=None).set_index("item_id")
    r0, r1, r2 = (frame.loc[f"harness_prompts/r{i}"] for i in range(3))
    assert r0["identical"] == 1 and np.isnan(r0["first_diff"]) and r0["cap_hit_ref"] == 1  # 16 chars = cap 16
    assert r1["identical"] == 0 and r1["first_diff"] == 0 and r1["json_ref"] == 1 and r1["json_quant"] == 0
    assert r1["refused_ref"] == 0 and r1["refused_quant"] == 1 and r1["cap_hit_quant"] == 1
    assert r2["cap_hit_ref"] == 0  # no cap of its own and none over the run
    assert (r2["language_prompt"], r2["language_ref"], r2["language_quant"]) == ("fr", "fr", "en")
    assert r2["in_language_ref"] == 1 and r2["in_language_quant"] == 0
    capped = prompt_outcomes.outcome_frame(items, rows, _tokenize, cap_override=4).set_index("item_id")
    assert capped["cap_hit_ref"].tolist() == [1, 1, 1]  # eval.max_gen_toks lowers every cap


def _planted(n_groups: int, per_group: int, refusals_added: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    replies, clusters = [], []
    for g in range(n_groups):
        for k in range(per_group):
            text = f"Answer {g}-{k}: restart the device and sign in again."
            replies.append((text, text))
            clusters.append(f"user-{g}")
    for index in rng.choice(len(replies), size=refusals_added, replace=False):
        replies[index] = (replies[index][0], "I'm sorry, but I can't help with that.")
    return prompt_outcomes.outcome_frame(_items(replies, clusters), {}, _tokenize)


def test_paired_metrics_count_what_the_table_holds_and_find_a_planted_change():
    frame = _planted(n_groups=40, per_group=3, refusals_added=18)
    metrics = prompt_outcomes.outcome_metrics(frame, n_resamples=500)
    n = len(frame)
    assert metrics["prompts/po_n"] == n
    assert metrics["prompts/po_refused_ref"] == 0.0
    assert metrics["prompts/po_refused_quant"] == pytest.approx(frame["refused_quant"].sum() / n)
    assert metrics["prompts/po_refused_delta"] == pytest.approx((frame["refused_quant"] - frame["refused_ref"]).mean())
    assert metrics["prompts/po_identical"] == pytest.approx(frame["identical"].mean())
    assert metrics["prompts/po_refused_delta_ci_low"] > 0  # 18 of 120 replies turned into refusals: found
    quiet = prompt_outcomes.outcome_metrics(_planted(n_groups=40, per_group=3, refusals_added=0), n_resamples=500)
    assert quiet["prompts/po_refused_delta"] == 0.0 and quiet["prompts/po_identical"] == 1.0
    assert quiet.get("prompts/po_refused_delta_ci_low", -1) <= 0 <= quiet.get("prompts/po_refused_delta_ci_high", 1)


def test_a_kept_format_counts_only_items_whose_reference_has_it():
    replies = [('{"k": %d}' % i, '{"k": %d}' % i if i % 4 else "k is %d" % i) for i in range(40)] + \
              [("plain text answer", "plain text answer")] * 10
    frame = prompt_outcomes.outcome_frame(_items(replies), {}, _tokenize)
    metrics = prompt_outcomes.outcome_metrics(frame, n_resamples=500)
    assert metrics["prompts/po_json_eligible"] == 40
    assert metrics["prompts/po_json_kept"] == pytest.approx(30 / 40)
    assert metrics["prompts/po_json_lost_delta"] == pytest.approx(-10 / 40)
    assert metrics["prompts/po_json_lost_delta_ci_high"] < 0
    section = prompt_outcomes.markdown(metrics, "prompts")
    assert "valid JSON" in section and "(40 items)" in section


def test_the_task_renders_each_rows_conversation_and_its_own_cap(tmp_path):
    log = tmp_path / "log.jsonl"
    rows = [{"id": "a", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
             "max_tokens": 12},
            {"id": "b", "prompt": "What is 2+2?"}]
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    from lm_eval.tasks import TaskManager

    metadata = {"path": str(log), "field": None, "sample": None, "max_tokens": 40, "seed": 1}
    manager = TaskManager(include_path=str(SLICES_DIR / "prompts"), include_defaults=False, metadata=metadata)
    task = manager.load(["harness_prompts"])["tasks"]["harness_prompts"]
    docs = {doc["id"]: doc for doc in task.test_docs()}
    seen = []

    def template(messages, add_generation_prompt=True):  # a chat template that shows what it was given
        seen.append(messages)
        return "|".join(f"{m['role']}:{m['content']}" for m in messages) + ("|assistant:" if add_generation_prompt
                                                                            else "")

    text = task.fewshot_context(docs["a"], 0, apply_chat_template=True, chat_template=template)
    assert text == "system:Be brief.|user:Hi|assistant:Hello!|user:Bye|assistant:"
    assert task.fewshot_context(docs["b"], 0).endswith("User: What is 2+2?\n\nAssistant:")
    caps = {key: task.construct_requests(doc, "ctx").arguments[1]["max_gen_toks"] for key, doc in docs.items()}
    assert caps == {"a": 12, "b": 40}  # the row's own cap, else prompts.max_tokens


def test_the_generator_reads_the_packaged_log_and_samples_it_by_stratum():
    generate = import_slice_module(SLICES_DIR / "prompts", "generate")
    everything = generate.items(seed=1234)
    log = prompt_log.load(generate.EXAMPLE)
    assert len(everything) == len(log.rows) and log.duplicates > 0
    assert {item["stratum"] for item in everything} >= {"support", "extraction_json", "code", "multilingual",
                                                        "sensitive"}
    sample = generate.items(sample=35, seed=1234)
    assert len(sample) == 35 and sample == generate.items(sample=35, seed=1234)
    assert len({item["stratum"] for item in sample}) == len({item["stratum"] for item in everything})


def test_mlflow_sees_hashes_in_place_of_a_private_slices_text():
    config = {"slices": {"prompts": {"tasks": ["harness_prompts"]}, "math": {"tasks": ["harness_math_gen"]}},
              "prompts": {"log_text": False}}
    assert private_slices(config) == {"prompts"}
    assert private_slices({**config, "prompts": {"log_text": True}}) == set()
    items = pd.DataFrame({"slice": ["prompts", "math"], "prompt": [f"secret {MARKER}", "2+2"],
                          "response_ref": ["a", "4"], "response_quant": ["", "4"], "target": ["", "4"]})
    shown = redacted_items(items, {"prompts"})
    assert MARKER not in shown.to_string()
    assert shown.loc[0, "prompt"] == f"sha256:{prompt_log.content_hash(f'secret {MARKER}')}"
    assert shown.loc[0, "response_quant"] == "" and shown.loc[1].tolist() == items.loc[1].tolist()


def _grep(root: Path, needle: bytes) -> list[str]:
    found = []
    for path in root.rglob("*"):
        if path.is_file() and needle in path.read_bytes():
            found.append(str(path.relative_to(root)))
    return found


@pytest.mark.slow
def test_a_job_on_your_log_keeps_its_text_local_unless_asked(tmp_path):
    """A whole tiny job on a log with a planted marker: the outcomes reach summary.json and the report; the marker
    is in the local items.parquet only, not in the MLflow store, the console or the job log; with
    prompts.log_text=true it is in MLflow too (so the check above can fail)."""
    log = tmp_path / "log.jsonl"
    rows = [{"id": f"r{i}", "group": f"user-{i // 2}", "stratum": ["support", "code"][i % 2],
             "messages": [{"role": "user", "content": f"Question {i}: how do I reset my password?"
                           + (f" {MARKER}" if i == 3 else "")}], "max_tokens": 6} for i in range(10)]
    rows.append(dict(rows[0], id="dup"))
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    def job(where: Path, *extra: str) -> subprocess.CompletedProcess:
        where.mkdir()
        return subprocess.run(
            [sys.executable, "-m", "harness", "model=tiny_random", "quant=int8", "slices=prompts",
             f"prompts.path={log}", f"paths.results_dir={where / 'results'}",
             f"tracking.uri=sqlite:///{where / 'mlflow.db'}", "compare.n_resamples=200", *extra],
            cwd=where, capture_output=True, text=True, timeout=600)  # MLflow's artifacts: where/mlruns

    private = job(tmp_path / "private")
    assert private.returncode == 0, private.stderr[-3000:]
    assert MARKER not in private.stdout + private.stderr
    results = next((tmp_path / "private" / "results").iterdir())
    summary = json.loads((results / "summary.json").read_text())
    assert summary["metrics"]["prompts/po_n"] == 10  # the duplicate dropped
    assert "## Your prompts" in (results / "report.md").read_text()
    assert set(pd.read_parquet(results / "prompt_outcomes.parquet")["stratum"]) == {"support", "code"}
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'private' / 'mlflow.db'}")
    run, = client.search_runs([client.get_experiment_by_name("quant-harness").experiment_id])
    assert run.data.metrics["detail/prompts/po_n"] == 10  # the outcomes reach the run's metrics
    assert "detail/prompts/po_refused_delta" in run.data.metrics
    assert _grep(tmp_path / "private", MARKER.encode()) == [str(results.relative_to(tmp_path / "private")
                                                                 / "items.parquet")]
    shown = job(tmp_path / "shown", "prompts.log_text=true")
    assert shown.returncode == 0, shown.stderr[-3000:]
    leaked = [p for p in _grep(tmp_path / "shown", MARKER.encode()) if not p.startswith("results/")]
    assert leaked, "with prompts.log_text=true the prompt text reaches MLflow"


def test_a_bad_log_is_refused_before_any_model_is_loaded(make_cfg, tmp_path):
    from harness.config import to_config
    from harness.job.pipeline import preflight

    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
                   + json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "hello"}]}) + "\n")
    cfg = to_config(make_cfg("model=tiny_random", "slices=prompts", f"prompts.path={log}"))
    with pytest.raises(prompt_log.PromptLogError, match=r"row 2: the last message is from 'assistant'"):
        preflight(cfg)
    missing = to_config(make_cfg("model=tiny_random", "slices=prompts", f"prompts.path={tmp_path / 'nope.jsonl'}"))
    with pytest.raises(prompt_log.PromptLogError, match="nope.jsonl"):
        preflight(missing)


def _outcome_run(metrics: dict) -> object:
    from harness.decision.gate_inputs import RunResults

    return RunResults(Path("."), {"metrics": metrics}, {}, pd.DataFrame())


def test_gate_reads_each_outcome_off_its_interval():
    from harness.config import GateConfig
    from harness.decision.criteria import outcome_criteria
    from harness.decision.gate_inputs import GateInputError

    metrics = {"prompts/po_n": 120, "prompts/po_refused_delta": 0.01, "prompts/po_refused_delta_ci_low": -0.01,
               "prompts/po_refused_delta_ci_high": 0.03, "prompts/po_json_eligible": 40,
               "prompts/po_json_lost_delta": -0.25, "prompts/po_json_lost_delta_ci_low": -0.40,
               "prompts/po_json_lost_delta_ci_high": -0.12, "prompts/po_loop_delta": 0.02,
               "prompts/po_loop_delta_ci_low": -0.01, "prompts/po_loop_delta_ci_high": 0.06}
    cfg = GateConfig(outcomes={"refused": 0.05, "json": 0.05, "loop": 0.03})
    found = {c.criterion: c for c in outcome_criteria(_outcome_run(metrics), cfg, ["prompts", "math"])}
    assert found["outcome_refused"].outcome == "pass"  # +3.0 at most, within 5
    assert found["outcome_json"].outcome == "fail"  # a loss of at least 12 pt, beyond 5
    assert found["outcome_json"].numbers["ci_low"] == pytest.approx(0.12)
    assert found["outcome_loop"].outcome == "inconclusive"  # [-1, +6] straddles 3
    assert "allowed at most 5.0 pt" in found["outcome_refused"].message
    with pytest.raises(GateInputError, match="gate.outcomes.refusals: unknown outcome"):
        outcome_criteria(_outcome_run(metrics), GateConfig(outcomes={"refusals": 0.02}), ["prompts"])


@pytest.mark.parametrize("base_rate", [0.02, 0.10])
def test_the_outcome_criterion_passes_a_change_at_the_limit_rarely(base_rate):
    """Measured, not assumed: refusals rising by exactly the limit (5 pt) over 120 prompts in 40 conversations of
    3, with conversations that share a propensity (a clustered design), pass in at most 5 % of 400 simulated runs
    (the 95 % interval's one-sided error is 2.5 % nominal)."""
    from harness.config import GateConfig
    from harness.decision.criteria import outcome_criteria
    from harness.stats.paired import paired_compare

    rng = np.random.default_rng(7)
    limit, groups, size, passes = 0.05, 40, 3, 0
    for _ in range(400):
        propensity = rng.beta(2, 2 / base_rate - 2, size=groups)  # mean base_rate, varying by conversation
        ref = rng.random((groups, size)) < propensity[:, None]
        turn = limit / (1 - base_rate)  # non-refusals that turn: the increase is the limit on average
        quant = ref | (rng.random((groups, size)) < turn)
        result = paired_compare(ref.ravel().astype(float), quant.ravel().astype(float),
                                clusters=np.repeat(np.arange(groups), size), n_resamples=200)
        metrics = {"prompts/po_n": groups * size, "prompts/po_refused_delta": result.delta,
                   "prompts/po_refused_delta_ci_low": result.delta_ci[0],
                   "prompts/po_refused_delta_ci_high": result.delta_ci[1]}
        decided, = outcome_criteria(_outcome_run(metrics), GateConfig(outcomes={"refused": limit}), ["prompts"])
        passes += decided.outcome == "pass"
    assert passes / 400 <= 0.05, passes
