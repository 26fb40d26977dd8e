"""Your own presets: config directories of your own (``--config-dir``, ``hydra.searchpath``,
``$HARNESS_CONFIG_PATH``), models named by hub id or path, and names that say what ran.

``tests/user_conf/`` is such a directory, outside the package: a model preset (``my_tiny``), a scheme on a plugin
number format (``toy3``) and an offline slice with its own lm-eval task YAML and generator (``team_compare``).
Before these existed, ``python -m harness "hydra.searchpath=[file://DIR]" model=my_model ...`` and
``python -m harness --config-dir DIR model=my_model ...`` both ended with ``error: unknown model option(s)
['my_model']`` (the harness checked names against its own conf/ only), and an overridden scheme kept its
preset's name (``quant=int8 quant.weights.format=toy_int3`` ran as ``int8``).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from harness import cli
from harness.config import compose, to_config
from harness.errors import UsageError
from harness.infra import presets

REPO = Path(__file__).resolve().parents[1]
USER_CONF = REPO / "tests" / "user_conf"
SEARCHPATH = f"hydra.searchpath=[file://{USER_CONF}]"


@pytest.fixture(autouse=True)
def _no_env_dirs(monkeypatch):
    """No config directory from the caller's environment; each test names its own."""
    monkeypatch.delenv(presets.ENV_VAR, raising=False)
    monkeypatch.setattr(presets, "_ACTIVE", None)  # restored after the test: no directory stays active


@pytest.fixture
def issue_dir(tmp_path: Path) -> Path:
    """The issue's reproduction: a copy of tiny_random saved as conf/model/my_model.yaml."""
    conf = tmp_path / "userconf" / "conf"
    (conf / "model").mkdir(parents=True)
    text = (REPO / "conf" / "model" / "tiny_random.yaml").read_text().replace("name: tiny_random", "name: my_model")
    (conf / "model" / "my_model.yaml").write_text(text)
    return conf


def _harness(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_the_issue_commands_compose_a_model_from_your_directory(issue_dir):
    """Both commands of the issue were refused before composing (exit 2, ``unknown model option(s)
    ['my_model']``); now each composes the model of your directory, and so does the environment variable."""
    for args, env in ((["hydra.searchpath=[file://%s]" % issue_dir], None),
                      (["--config-dir", str(issue_dir)], None),
                      ([], {presets.ENV_VAR: str(issue_dir)})):
        done = _harness(*args, "model=my_model", "quant=int8", "slices=[math]", "--cfg", "job", env=env)
        assert done.returncode == 0, done.stderr
        assert "unknown model option" not in done.stderr
        assert "\n  name: my_model\n" in done.stdout and "\n  name: int8\n" in done.stdout


def test_the_option_check_lists_your_presets_with_their_source(issue_dir, monkeypatch):
    assert cli.group_option_problem([f"hydra.searchpath=[file://{issue_dir}]", "model=my_model"]) is None
    assert cli.group_option_problem(["--config-dir", str(issue_dir), "model=my_model"]) is None
    monkeypatch.setenv(presets.ENV_VAR, os.pathsep.join([str(issue_dir), str(USER_CONF)]))
    assert cli.group_option_problem(["model=my_model", "quant=toy3", "slices=[math,team_compare]"]) is None
    problem = cli.group_option_problem(["model=my_modle"])
    assert problem.startswith("unknown model option(s) ['my_modle']; available model options: ")
    assert "tiny_random (packaged)" in problem
    assert f"my_model (from {issue_dir} (${presets.ENV_VAR}))" in problem
    assert f"my_tiny (from {USER_CONF} (${presets.ENV_VAR}))" in problem
    assert "or hf:<hub id or local directory>" in problem
    assert "\n" not in problem  # one line


def test_a_missing_directory_is_one_line_naming_who_named_it(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere"
    assert "--config-dir names" in cli.group_option_problem(["--config-dir", str(missing), "model=tiny_random"])
    monkeypatch.setenv(presets.ENV_VAR, str(missing))
    with pytest.raises(UsageError, match=rf"\$HARNESS_CONFIG_PATH names {missing}, which is not a directory"):
        compose(["model=tiny_random"])


def test_directories_come_first_to_last_command_line_then_environment(tmp_path):
    a, b, c = (tmp_path / n for n in "abc")
    for d in (a, b, c):
        d.mkdir()
    found = presets.requested(["--config-dir", str(a), f"hydra.searchpath=[file://{b},{a}]"], {presets.ENV_VAR: str(c)})
    assert [(d.path, d.via) for d in found] == [(a, "--config-dir"), (b, "hydra.searchpath"),
                                                (c, f"${presets.ENV_VAR}")]


def test_a_preset_of_yours_shadows_the_packaged_one_and_says_so_in_one_line(tmp_path, capsys):
    conf = tmp_path / "conf"
    (conf / "quant").mkdir(parents=True)
    (conf / "quant" / "int8.yaml").write_text("name: int8_team\nmethod: rtn\n"
                                              "weights: {format: int, bits: 6, granularity: channel}\n")
    cfg = compose([f"hydra.searchpath=[file://{conf}]", "model=tiny_random", "quant=int8"])
    assert (cfg.quant.name, cfg.quant.weights.bits) == ("int8_team", 6)  # yours, not the package's 8 bits
    assert compose(["model=tiny_random", "quant=int8"]).quant.weights.bits == 8  # the package's, without it
    note = presets.shadow_note(presets.requested(["--config-dir", str(conf)]))
    assert note == f"your presets shadow packaged ones of the same name (yours are used): quant=int8 from {conf}"
    assert cli.main(cli.Tool(prog="p", summary="", run_config=True), lambda parsed: 0,
                    ["--config-dir", str(conf), "quant=int8"]) == 0
    assert capsys.readouterr().err.strip() == note


def test_a_tools_help_lists_every_preset_with_its_source(capsys):
    tool = cli.Tool(prog="python -m harness.toy", summary="A toy tool.", run_config=True)
    assert cli.main(tool, lambda parsed: 0, ["--config-dir", str(USER_CONF), "--help"]) == 0
    lines = {line.split("=")[0].strip(): line for line in capsys.readouterr().out.splitlines() if "=  " in line}
    assert "tiny_random (packaged)" in lines["model"] and f"my_tiny (from {USER_CONF} (--config-dir))" in lines["model"]
    assert f"toy3 (from {USER_CONF} (--config-dir))" in lines["quant"]
    assert f"team_compare (from {USER_CONF} (--config-dir))" in lines["slices"]


# ---------------------------------------------------------------------------------------------------------------
# a model from its hub id or its directory, without a preset


def test_a_hub_id_composes_a_model_without_a_preset_and_without_the_network(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("composing model=hf:<id> must not touch the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = to_config(compose(["model=hf:Qwen/Qwen3-8B", "quant=int8", "slices=[math]"]))
    assert (cfg.model.name, cfg.model.source, cfg.model.path) == ("Qwen3-8B", "hf", "Qwen/Qwen3-8B")
    assert cli.group_option_problem(["model=hf:Qwen/Qwen3-8B,hf:meta-llama/Llama-3.1-8B-Instruct"]) is None


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    """A tiny random Llama saved with save_pretrained, as a fine-tune's directory would hold it."""
    from tiny_models import tiny_llama

    directory = tmp_path_factory.mktemp("ckpt") / "team-ft-7"
    tiny_llama(vocab_size=96, hidden_size=64, layers=3, heads=4, kv_heads=2, max_position_embeddings=1024) \
        .save_pretrained(directory)
    return directory


@pytest.mark.slow
def test_a_model_directory_composes_with_its_name_and_shape_from_its_config(saved_model):
    from harness.sizing import ledger

    for overrides in (["model=hf:" + str(saved_model)], ["model.path=" + str(saved_model)]):
        cfg = to_config(compose([*overrides, "quant=int8"]))
        assert (cfg.model.name, cfg.model.source, cfg.model.path) == ("team-ft-7", "hf", str(saved_model))
        assert cfg.model.max_length == 1024 and cfg.model.chat_template is False  # its config; no chat template
        arch = ledger.architecture(cfg.model)  # the ledger and the planner read its config.json
        assert (arch.layers, arch.kv_heads, arch.head_dim, arch.hidden_size, arch.vocab_size) == (3, 2, 16, 64, 96)


@pytest.mark.slow
def test_the_ledger_tool_reads_a_model_directory_given_by_path(saved_model, tmp_path, capsys):
    from harness.sizing import ledger

    assert ledger.main([f"model.path={saved_model}", "quant=int8", f"out={tmp_path / 'ledger'}"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# team-ft-7 · int8: ") and "3 layers, 2 KV heads × 16" in out
    assert (tmp_path / "ledger" / "ledger.csv").exists()


# ---------------------------------------------------------------------------------------------------------------
# names that say what ran


def test_an_overridden_scheme_is_named_after_its_overrides():
    base = ["model=tiny_random", "quant=int8", "quant.plugins=[tests.quant.toy_format]"]
    plain = compose(["model=tiny_random", "quant=int8"]).quant.name
    toy = compose([*base, "quant.weights.format=toy_int3"]).quant.name
    assert plain == "int8"
    assert toy == "int8+plugins=[tests.quant.toy_format]+weights.format=toy_int3"
    assert compose(["model=tiny_random", "quant=int8", "quant.weights.bits=4"]).quant.name == "int8+weights.bits=4"
    assert compose(["model=tiny_random", "quant=kv8", "+quant/kv_cache=fp8_dynamic"]).quant.name == \
        "kv8+kv_cache=fp8_dynamic"
    # a name of your own wins, and the order of the overrides does not change the name
    assert compose([*base, "quant.weights.format=toy_int3", "quant.name=w3"]).quant.name == "w3"
    assert compose(["model=tiny_random", "quant=int8", "quant.weights.group_size=64", "quant.weights.bits=4"]) \
        .quant.name == compose(["model=tiny_random", "quant=int8", "quant.weights.bits=4",
                                "quant.weights.group_size=64"]).quant.name


def test_two_runs_that_differ_in_a_scheme_field_never_share_a_run_name():
    from harness.job.identity import run_name

    names = {run_name(to_config(compose(["model=tiny_random", "quant=int8", "slices=[math]", *extra])))
             for extra in ([], ["quant.weights.bits=4"], ["quant.weights.bits=6"], ["quant.weights.symmetric=false"],
                           ["quant.calibration.num_samples=16"])}
    assert len(names) == 5
    assert "tiny_random/int8+weights.bits=4/math" in names


@pytest.mark.slow
def test_python_m_harness_names_a_job_after_its_overrides(tmp_path):
    """Hydra's own composition (``python -m harness``) gives the job the same name as :func:`compose`."""
    results = tmp_path / "results"
    done = _harness("model=tiny_random", "quant=int8", "quant.weights.bits=6", "slices=[math]",
                    "slices.math.n_items=6", "slices.math.divergence_texts=2", "eval.max_gen_toks=4",
                    "tracking.enabled=false", "runtime.reference_process=false", f"paths.results_dir={results}",
                    f"paths.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'hydra'}",
                    env={"OMP_NUM_THREADS": "1", "HARNESS_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-2000:]
    [summary] = results.rglob("summary.json")
    assert json.loads(summary.read_text())["scheme"] == "int8+weights.bits=6"
    assert summary.parent.name.startswith("tiny_random__int8+weights.bits_6__math__")


# ---------------------------------------------------------------------------------------------------------------
# a whole job from your directory: your model, your scheme (a plugin number format) and your slice


@pytest.mark.slow
def test_a_job_runs_your_model_scheme_and_slice_and_names_what_ran(make_cfg, tmp_path):
    from mlflow.tracking import MlflowClient

    from harness.job import pipeline
    from harness.quant.format_table import unregister_format
    from tests.quant.toy_format import TOY

    sys.modules.pop("tests.quant.toy_format", None)  # the scheme's plugins: entry registers the format
    unregister_format(TOY)
    try:
        cfg = make_cfg(SEARCHPATH, "model=my_tiny", "quant=toy3", "quant.weights.granularity=tensor",
                       "slices=[team_compare]", "slices.team_compare.n_items=12", "slices.team_compare.divergence_texts=4",
                       "runtime.reference_process=false")
        result = pipeline.run(cfg)
    finally:
        unregister_format(TOY)
    assert result["model"] == "my_tiny" and result["scheme"] == "toy3+weights.granularity=tensor"
    assert result["quant"]["bits_per_weight"] == pytest.approx(3.0, abs=0.01)  # the plugin's 3-bit grid
    assert result["run_name"] == "my_tiny/toy3+weights.granularity=tensor/team_compare"
    assert result["metrics"]["team_compare/n"] == 12
    [directory] = [p.parent for p in (tmp_path / "results").rglob("summary.json")]
    assert directory.name.startswith("my_tiny__toy3+weights.granularity_tensor__team_compare__")
    assert (directory / "report.md").read_text().startswith(f"# {result['run_name']}")
    [run] = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_runs(
        [e.experiment_id for e in MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_experiments()])
    assert run.info.run_name.startswith("toy3+weights.granularity=tensor · my_tiny")
    assert run.data.params["quant.name"] == "toy3+weights.granularity=tensor"
