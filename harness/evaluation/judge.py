"""The pairwise judge as a stage: start or reach the judge, judge a run's replies, write its frames and metrics.

:func:`run_judge` is what the job calls after its items are paired (``judge.endpoint`` or ``judge.serve`` set), and
what ``python -m harness.evaluation.judge RESULTS_DIR judge.endpoint=URL`` calls on a finished run's saved replies
(:func:`main`). What is judged and how: :mod:`harness.evaluation.judge_client`; the statistics:
:mod:`harness.evaluation.judge_stats`. The files, none holding prompt, reply or judge text: ``judge.parquet`` (per
item: the two verdicts, the outcome, order consistency), ``judge_stats.parquet`` (per slice and stratum).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import pandas as pd

from harness import cli
from harness.config import JudgeConfig
from harness.engines.openai_http import redact_url
from harness.errors import UsageError, UserError
from harness.evaluation import judge_client as judge, judge_stats

log = logging.getLogger(__name__)

FRAME, TABLE = "judge.parquet", "judge_stats.parquet"


@dataclass
class JudgeResult:
    frame: pd.DataFrame  # per item (judge_stats.outcome_frame)
    table: pd.DataFrame  # per slice and stratum (judge_stats.strata_table)
    metrics: dict[str, float]  # <slice>/judge_*
    params: dict[str, Any] = field(default_factory=dict)  # the judge's model, requests, retries, seconds


@contextlib.contextmanager
def judge_client(cfg: JudgeConfig, log_dir: Path) -> Iterator[judge.JudgeClient]:
    """A connected client of the judge: ``judge.endpoint`` as given, or ``judge.serve`` started on a free loopback
    port (its log ``judge_serve.log`` in ``log_dir``) and stopped on leaving."""
    process = None
    if cfg.serve:
        from harness.engines.vllm_serve import ServedProcess

        process = ServedProcess(str(cfg.serve), Path(log_dir) / "judge_serve.log",
                                startup_timeout_s=float(cfg.serve_startup_s), secret_env=cfg.api_key_env, role="judge")
        process.start()
    try:
        client = judge.JudgeClient(process.url if process else str(cfg.endpoint), cfg, server=process)
        client.connect()
        yield client
    finally:
        if process is not None:
            process.stop()


def conversations_from_rows(rows: list[Mapping[str, Any]]) -> dict[str, str]:
    """Item id -> the conversation as the user saw it, from a prompt-log slice's rows (``messages_json``)."""
    from harness.evaluation.prompt_log import TASK

    return {f"{TASK}/{row['id']}": judge.render_conversation(json.loads(row["messages_json"])) for row in rows}


def run_judge(cfg: JudgeConfig, items: pd.DataFrame, conversations: Mapping[str, str], *, log_dir: Path,
              ci_level: float = 0.95) -> JudgeResult:
    """Judge the paired ``items`` (items.parquet's rows) of ``judge.slices``; their frames, metrics and parameters."""
    pairs = judge.pairs_from_items(items, cfg.slices, conversations)
    if not pairs:
        raise judge.JudgeConfigError(f"judge.slices={list(cfg.slices)}: none of the run's items belong to them; "
                                     "name slices the run evaluated")
    started = time.monotonic()
    with judge_client(cfg, log_dir) as client:
        verdicts = judge.judge_pairs(pairs, client, int(cfg.concurrency))
        params = {"judge.model": client.model, "judge.endpoint": redact_url(str(cfg.endpoint)) if cfg.endpoint
                  else "serve", "judge.requests": client.requests, "judge.retries": client.retries}
    params["judge.seconds"] = round(time.monotonic() - started, 1)
    frame = judge_stats.outcome_frame(verdicts)
    metrics = judge_stats.judge_metrics(frame, ci_level=ci_level)
    table = judge_stats.strata_table(frame, ci_level=ci_level)
    log.info("judge %s: %d items, %d requests (%d retried), %.0f s", client.model, len(frame), client.requests,
             client.retries, params["judge.seconds"])
    return JudgeResult(frame, table, metrics, params)


def write(result: JudgeResult, directory: Path) -> None:
    """``judge.parquet`` and ``judge_stats.parquet`` in ``directory`` (numbers and labels only: no text)."""
    directory.mkdir(parents=True, exist_ok=True)
    result.frame.to_parquet(directory / FRAME, index=False)
    result.table.to_parquet(directory / TABLE, index=False)


def report_section(directory: Path, metrics: Mapping[str, float], slice_name: str,
                   judge_name: Optional[str] = None) -> str:
    """The report's judge section of one slice ("" when the slice was not judged); strata from judge_stats.parquet."""
    path = Path(directory) / TABLE
    table = pd.read_parquet(path) if path.exists() else None
    return judge_stats.markdown(metrics, slice_name, table, judge_name or "")


# ------------------------------------------------------------------------------------- CLI: a finished run's replies
@dataclass
class JudgeOptions:
    paths: list[str] = field(default_factory=list, metadata={"help": "one results/<run> directory"})
    judge: JudgeConfig = field(default_factory=JudgeConfig, metadata={"help": "judge.endpoint or judge.serve, ..."})
    out: Optional[str] = field(default=None, metadata={"help": "where the judge's files go (default RESULTS_DIR/judge)"})
    ci_level: Optional[float] = field(default=None, metadata={"help": "interval level (default: the run's compare)"})


TOOL = cli.Tool(prog="python -m harness.evaluation.judge", positional="paths", options=JudgeOptions,
                summary="Judge a finished run's replies pairwise (reference vs candidate, blind, both orders) with an "
                        "LLM behind an OpenAI-compatible chat endpoint. Writes judge.parquet, judge_stats.parquet, "
                        "judge.json and judge.md to out=.")


def saved_conversations(config: dict, slices: list[str]) -> dict[str, str]:
    """The conversations of a saved run's prompt-log slices, re-read from its log; {} (the rendered prompts are
    used) when the log cannot be read again."""
    from harness.config import SliceConfig
    from harness.evaluation.prompt_log import TASK
    from harness.evaluation.slices import resolve

    out: dict[str, str] = {}
    known = {f.name for f in dataclasses.fields(SliceConfig)}
    for name in slices:
        given = (config.get("slices") or {}).get(name) or {}
        if TASK not in (given.get("tasks") or []):
            continue
        try:
            slice_ = resolve({name: SliceConfig(**{k: v for k, v in given.items() if k in known})})[0]
            rows = slice_.items(**slice_.metadata(int((config.get("eval") or {}).get("seed", 1234))))
        except (UserError, OSError, ValueError) as exc:
            log.warning("the prompt log of %s cannot be read again (%s): the judge reads the prompt as rendered",
                        name, str(exc).splitlines()[0])
            continue
        out.update(conversations_from_rows(rows))
    return out


def _body(parsed: cli.Parsed[JudgeOptions]) -> int:
    options = parsed.options
    assert options is not None
    if len(options.paths) != 1:
        raise UsageError("give one results directory: python -m harness.evaluation.judge RESULTS_DIR "
                             "judge.endpoint=URL")
    directory = Path(options.paths[0])
    missing = [name for name in ("config.json", "items.parquet") if not (directory / name).is_file()]
    if missing:
        raise UsageError(f"{directory} has no {' or '.join(missing)}: give a finished run's results directory")
    config = json.loads((directory / "config.json").read_text())
    cfg = options.judge
    if not judge.enabled(cfg):
        raise UsageError("no judge: set judge.endpoint=URL or judge.serve='<command with {port}>'")
    judge.check_config(cfg, list((config.get("slices") or {}).keys()))
    ci_level = options.ci_level or float((config.get("compare") or {}).get("ci_level", 0.95))
    items = pd.read_parquet(directory / "items.parquet")
    out = Path(options.out) if options.out else directory / "judge"
    result = run_judge(cfg, items, saved_conversations(config, list(cfg.slices)), log_dir=out, ci_level=ci_level)
    write(result, out)
    (out / "judge.json").write_text(json.dumps({"metrics": result.metrics, "params": result.params,
                                                "run": directory.name}, indent=1, default=str))
    text = "\n".join(section for name in cfg.slices
                     if (section := judge_stats.markdown(result.metrics, name, result.table, str(result.params
                                                                                                 .get("judge.model")))))
    (out / "judge.md").write_text(text)
    print(text)
    print(f"written: {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.main(TOOL, _body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
