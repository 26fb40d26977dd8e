"""The shared command-line convention (harness.cli): options, run overrides, bare paths, errors."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from harness import cli


@dataclass
class ToyOptions:
    paths: list[str] = field(default_factory=list)
    margin: float = 0.02
    out: str | None = None
    tags: dict[str, str] = field(default_factory=dict)


TOY = cli.Tool(prog="python -m harness.toy", summary="A toy tool.", options=ToyOptions, run_config=True,
               positional="paths", flags=("-m",))


def test_options_overrides_paths_and_flags_are_separated():
    parsed = cli.parse(TOY, ["results/a", "margin=0.05", "quant=int8", "tags.team=x", "-m", "results/b"])
    assert parsed.options == ToyOptions(paths=["results/a", "results/b"], margin=0.05, tags={"team": "x"})
    assert parsed.overrides == ["quant=int8"]
    assert parsed.flags == {"-m"}


def test_the_run_config_is_composed_as_the_main_command_does():
    parsed = cli.parse(TOY, ["quant=int8", "model=tiny_random"])
    assert parsed.run.quant.name == "int8"
    assert parsed.run.model.name == "tiny_random"


def test_a_wrong_type_names_the_key_and_lists_the_options():
    with pytest.raises(cli.UsageError, match="margin"):
        cli.parse(TOY, ["margin=abc"])


def test_an_unknown_key_of_a_tool_without_run_config_is_listed():
    tool = cli.Tool(prog="python -m harness.toy", summary="", options=ToyOptions)
    with pytest.raises(cli.UsageError, match=r"unknown option 'marign'.*margin"):
        cli.parse(tool, ["marign=0.1"])


def test_an_unknown_group_option_fails_before_composing():
    with pytest.raises(cli.UsageError, match="unknown quant option"):
        cli.parse(TOY, ["quant=int5"])


def test_a_former_method_settings_key_is_refused_naming_its_new_key_before_composing():
    """``python -m harness`` reads group_option_problem before Hydra composes: one line, not Hydra's error."""
    problem = cli.group_option_problem(["quant=gptq_w4g128", "quant.gptq.damp_percent=0.1"])
    assert problem is not None and problem.endswith("use quant.settings.damp_percent")
    assert cli.group_option_problem(["quant=gptq_w4g128", "quant.settings.damp_percent=0.1"]) is None


def test_an_unknown_run_key_fails_when_composed():
    with pytest.raises(cli.UsageError, match="eval.batchsize|batchsize"):
        _ = cli.parse(TOY, ["eval.batchsize=3"]).run


def test_unknown_flags_and_stray_words_are_usage_errors():
    with pytest.raises(cli.UsageError, match="--gpus"):
        cli.parse(TOY, ["--gpus"])
    with pytest.raises(cli.UsageError, match="not key=value"):
        cli.parse(cli.Tool(prog="p", summary="", options=ToyOptions), ["stray"])


def test_main_prints_help_and_turns_user_errors_into_one_line(capsys):
    assert cli.main(TOY, lambda parsed: 0, ["--help"]) == 0
    out = capsys.readouterr().out
    assert "margin=0.02" in out and "quant=" in out and "int4_g128" in out

    def body(parsed):
        raise cli.UsageError("the thing is wrong; do this instead")

    assert cli.main(TOY, body, []) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.strip() == "error: the thing is wrong; do this instead"


def test_main_keeps_the_traceback_of_a_real_bug():
    def body(parsed):
        raise ZeroDivisionError("bug")

    with pytest.raises(ZeroDivisionError):
        cli.main(TOY, body, [])
