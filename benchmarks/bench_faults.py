"""Fault injection into real jobs: what the user sees, what is recomputed, and that no item is lost.

Each fault is injected into a real ``python -m harness`` process on ``tiny_random`` (the math
slice, both tasks) and the job's final per-item records (``items.parquet``) are compared with an
undisturbed job's of the same config; "items lost" counts the undisturbed items that are missing
or differ. The faults:

* a cache entry damaged on disk (COMPLETE present): reference ``records.parquet`` truncated, the
  frozen head truncated, a calibrated-weights shard with one byte flipped (GPTQ), the model
  cache's tokenizer truncated, and an entry from before manifests (``COMPLETE`` = ``ok``) damaged;
* disk: the issue's 60 kB tmpfs as results directory (refused at start), and a tmpfs that fills
  up once requests are stored, then the same command with space (tmpfs in ``unshare -rm``);
* CUDA out of memory on every forward of more than two rows (``torch.cuda.OutOfMemoryError``
  raised in the input embedding's pre-hook, both models);
* the reference's second process SIGKILLed (what the kernel's OOM killer sends) and SIGSTOPped
  (a stall, ``runtime.reference_stall_s=20``);
* the existing ones: SIGKILL of the job mid-evaluation and a rerun, tracking server down then
  ``harness.results.sync``, a stale lock of a dead process, and a live reference owner that dies.

Writes benchmarks/results/faults.json and prints the README's Markdown table.

    .venv/bin/python benchmarks/bench_faults.py [--only NAME ...]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
TINY = ["model=tiny_random", "slices=[math]", "slices.math.n_items=9", "slices.math.divergence_texts=2",
        "slices.math.tasks=[harness_math_gen,harness_math_mc]", "compare.n_resamples=1000",
        "runtime.threads=1", "runtime.reference_process=false", "tracking.enabled=false"]
USER_MODELS = Path(os.environ.get("HARNESS_CACHE_DIR", "~/.cache/quant-harness")).expanduser() / "models"
# the lines a user reads about a fault (warnings and errors of the harness, not lm-eval's chatter)
SIGNAL_LINE = re.compile(r"damaged cache entry|^error: |CUDA out of memory on a batch|reference process pid|"
                         r"broke the stale lock|TRACKING UNAVAILABLE|not logged to MLflow|another job is computing|"
                         r"ended without finishing|reusing them|resum", re.M)


@dataclass
class Outcome:
    fault: str
    injected: str
    exit_codes: list[int]
    message: str
    recomputed: str
    items: int
    items_lost: int
    seconds: float


def env() -> dict[str, str]:
    out = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    out.pop("MLFLOW_TRACKING_URI", None)
    return out


def fresh_cache(root: Path, like: Path | None = None) -> Path:
    """A cache whose models namespace is the user's (tiny_random's tokenizer); others copied from ``like``."""
    root.mkdir(parents=True)
    (root / "models").symlink_to(USER_MODELS)
    if like is not None:
        for part in like.iterdir():
            if part.name != "models":
                shutil.copytree(part, root / part.name, symlinks=True)
    return root


def command(args: list[str], program: str | None = None) -> list[str]:
    if program is None:
        return [sys.executable, "-m", "harness", *args]
    return [sys.executable, "-c", program, *args]


def job(args: list[str], log: Path, program: str | None = None) -> tuple[int, str]:
    with log.open("w") as out:
        rc = subprocess.run(command(args, program), cwd=REPO, env=env(), stdout=out, stderr=subprocess.STDOUT,
                            timeout=1800).returncode
    return rc, log.read_text()


def start(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(command(args), cwd=REPO, env=env(), stdout=log.open("w"), stderr=subprocess.STDOUT)


def items_of(results: Path) -> pd.DataFrame:
    return pd.read_parquet(next(results.glob("*/items.parquet")))


def lost(results: Path, undisturbed: pd.DataFrame) -> int:
    """Undisturbed items missing from ``results`` or differing there (0: the same records)."""
    try:
        got = items_of(results).set_index("item_id")
    except StopIteration:
        return len(undisturbed)
    want = undisturbed.set_index("item_id")
    common = want.index.intersection(got.index)
    differ = (want.loc[common].astype(str) != got.loc[common, want.columns].astype(str)).any(axis=1).sum()
    return int(len(want) - len(common) + differ)


def summary_of(results: Path) -> dict:
    return json.loads(next(results.glob("*/summary.json")).read_text())


def said(text: str, pattern: str | None = None) -> str:
    """The first line of the log a user reads about the fault (the harness's own words)."""
    lines = [line.split("] - ", 1)[-1].strip() for line in text.replace("\r", "\n").splitlines()
             if SIGNAL_LINE.search(line.split("] - ", 1)[-1])]
    if pattern:
        lines = [line for line in lines if re.search(pattern, line)] or lines
    return lines[0][:400] if lines else "(nothing)"


def what_was_computed(results: Path) -> str:
    try:
        summary = summary_of(results)
    except StopIteration:
        return "nothing (refused before any work)"
    reference = "reference reused" if all(summary["reference_cached"].values()) else "reference computed"
    restored = sum(summary["checkpoint"]["restored_requests"].values())
    ref_restored = sum(summary["checkpoint"]["reference_restored_requests"].values())
    return (f"{reference}; requests replayed from checkpoints: {restored} candidate, "
            f"{ref_restored} reference")


def checkpoint_rows(results: Path) -> int:
    total = 0
    for path in results.glob("*/checkpoint/*_rank*.db"):
        with contextlib.closing(sqlite3.connect(path, timeout=10)) as db, contextlib.suppress(sqlite3.Error):
            total += db.execute("SELECT COUNT(*) FROM unnamed").fetchone()[0]
    return total


def unshare_works() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /tmp"], capture_output=True).returncode == 0


def reference_key_of(args: list[str]) -> str:
    sys.path.insert(0, str(REPO))
    from harness.models import loading as models
    from harness.config import compose
    from harness.job.identity import ReferenceSpec, reference_key
    from harness.config import to_config
    from harness.evaluation.slices import resolve

    cfg = to_config(compose(args))
    loaded = models.load(cfg.model, cfg.paths.cache_dir)
    return reference_key(loaded, resolve(cfg.slices)[0], ReferenceSpec.of(cfg))


OOM_PROGRAM = """
import runpy, sys, torch
import harness.models.loading as models
load = models.load
def out_of_memory(module, args):
    if args[0].shape[0] > 2:
        raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected: a batch of {args[0].shape[0]} rows)")
def patched(*a, **k):
    loaded = load(*a, **k)
    loaded.model.get_input_embeddings().register_forward_pre_hook(out_of_memory)
    return loaded
models.load = patched
sys.argv = ["harness", *sys.argv[1:]]
runpy.run_module("harness", run_name="__main__", alter_sys=True)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="run only these faults (names as in the table)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "faults.json"))
    parser.add_argument("--model", default="tiny_random", help="model config (smollm2_135m: minutes per job)")
    options = parser.parse_args()
    TINY[0] = f"model={options.model}"
    work = Path(tempfile.mkdtemp(prefix="bench-faults-"))
    load_before = os.getloadavg()
    outcomes: list[Outcome] = []
    base = fresh_cache(work / "cache-base")

    def paths(name: str, cache: Path) -> list[str]:
        return [f"paths.results_dir={work / name}", f"paths.cache_dir={cache}"]

    # the undisturbed jobs every fault is compared with (and whose cache entries the corruption faults damage)
    rc, text = job([*TINY, "quant=int8", *paths("undisturbed", base)], work / "undisturbed.log")
    assert rc == 0, text[-3000:]
    undisturbed = items_of(work / "undisturbed")
    undisturbed_gptq = None
    if not options.only or "calibrated entry bit flip" in options.only:
        rc, text = job([*TINY, "quant=gptq_w4g128", *paths("undisturbed-gptq", base)], work / "undisturbed-gptq.log")
        assert rc == 0, text[-3000:]
        undisturbed_gptq = items_of(work / "undisturbed-gptq")

    def save() -> None:
        faults = [asdict(o) for o in outcomes]
        if options.only and Path(options.out).exists():  # a partial run replaces its faults' rows only
            mine = {o.fault for o in outcomes}
            faults = [f for f in json.loads(Path(options.out).read_text())["faults"] if f["fault"] not in mine] + faults
        record = {"machine": {"cpus": os.cpu_count(), "load_before": load_before, "load_now": os.getloadavg()},
                  "config": TINY, "faults": faults}
        Path(options.out).write_text(json.dumps(record, indent=1) + "\n")

    def fault(name: str, injected: str):
        def register(body: Callable[[Path], tuple[list[int], str, Path, pd.DataFrame]]):
            if options.only and name not in options.only:
                return body
            begin = time.perf_counter()
            directory = work / name.replace(" ", "-").replace("/", "-")
            directory.mkdir()
            codes, message, results, reference = body(directory)
            aside = sorted(directory.glob("cache/*/*.corrupt-*"))
            moved = [f"damaged {p.parent.name} entry moved aside" + (
                ", rebuilt" if (p.parent / p.name.split(".corrupt-")[0] / "COMPLETE").exists() else ", not rebuilt")
                for p in aside]
            recomputed = "; ".join([what_was_computed(results), *moved])
            outcomes.append(Outcome(name, injected, codes, message, recomputed, len(reference),
                                    lost(results, reference), round(time.perf_counter() - begin, 1)))
            print(f"{name}: exit {codes}, lost {outcomes[-1].items_lost}; {message[:160]}", flush=True)
            save()  # after every fault: an interrupted run keeps what it measured
            return body
        return register

    def damaged_rerun(directory: Path, damage: Callable[[Path], None], quant: str = "int8",
                      reference: pd.DataFrame | None = None) -> tuple[list[int], str, Path, pd.DataFrame]:
        cache = fresh_cache(directory / "cache", like=base)
        damage(cache)
        rc, text = job([*TINY, f"quant={quant}", *paths(f"{directory.name}/results", cache)], directory / "job.log")
        return [rc], said(text, "damaged"), directory / "results", undisturbed if reference is None else reference

    def truncate(path: Path) -> None:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])

    @fault("reference entry truncated", "records.parquet cut to half its bytes, COMPLETE kept")
    def _(directory):
        return damaged_rerun(directory, lambda c: truncate(next(c.glob("reference/*/records.parquet"))))

    @fault("head entry truncated", "heads/<model>/head.pt cut to half")
    def _(directory):
        return damaged_rerun(directory, lambda c: truncate(next(c.glob("heads/*/head.pt"))))

    @fault("calibrated entry bit flip", "one byte of a GPTQ weights shard flipped (same size)")
    def _(directory):
        def flip(cache: Path) -> None:
            shard = next(cache.glob("calibrated/*/weights-*.safetensors"))
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF
            shard.write_bytes(bytes(data))
        return damaged_rerun(directory, flip, "gptq_w4g128", undisturbed_gptq)

    @fault("old entry damaged", "an entry from before manifests (COMPLETE = ok), records.parquet truncated")
    def _(directory):
        def old(cache: Path) -> None:
            entry = next(cache.glob("reference/*/records.parquet")).parent
            (entry / "COMPLETE").write_text("ok\n")
            truncate(entry / "records.parquet")
        return damaged_rerun(directory, old)

    @fault("model cache tokenizer truncated", "tokenizer.json of the packaged model's cache entry cut to half")
    def _(directory):
        cache = directory / "cache"
        cache.mkdir()
        models = cache / "models"
        shutil.copytree(USER_MODELS, models, copy_function=os.link)  # hard links: 0.5 GB not copied
        tokenizer = next(models.glob("*/tokenizer.json"))
        data = tokenizer.read_bytes()
        tokenizer.unlink()  # a file of its own, so the user's cache stays intact
        tokenizer.write_bytes(data[: len(data) // 2])
        rc, text = job([*TINY, "quant=int8", *paths(f"{directory.name}/results", cache)], directory / "job.log")
        return [rc], said(text, "damaged"), directory / "results", undisturbed

    if unshare_works():
        @fault("disk 60 kB", "results directory on a 60 kB tmpfs (the issue's)")
        def _(directory):
            cmd = " ".join(command([*TINY, "quant=int8", f"paths.cache_dir={base}", "paths.results_dir=$R/r"]))
            out = subprocess.run(["unshare", "-rm", "sh", "-c", f"R={directory}; mount -t tmpfs -o size=60k tmpfs $R;"
                                  f" {cmd}"], cwd=REPO, env=env(), capture_output=True, text=True, timeout=900)
            return [out.returncode], said(out.stderr), directory / "none", undisturbed.iloc[0:0]

        @fault("disk fills up mid-job", "48 MB tmpfs filled by another writer once requests are stored; rerun")
        def _(directory):
            mount = directory / "mnt"
            mount.mkdir()
            cmd = " ".join(command([*TINY, "quant=int8", f"paths.cache_dir={fresh_cache(directory / 'cache')}",
                                    "paths.results_dir=$R/results", "eval.batch_size=1"]))
            script = f"""R={mount}; mount -t tmpfs -o size=48m tmpfs $R
                ( while ! ls $R/results/*/checkpoint/*_rank0.db >/dev/null 2>&1; do sleep 0.05; done
                  sleep 0.5; cat /dev/zero > $R/filler 2>/dev/null ) &
                {cmd} > {directory}/first.log 2>&1; echo $? > {directory}/rc1; wait; rm -f $R/filler
                {cmd} > {directory}/second.log 2>&1; echo $? > {directory}/rc2; cp -r $R/results {directory}/kept"""
            subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=REPO, env=env(), timeout=1800)
            codes = [int((directory / f"rc{i}").read_text()) for i in (1, 2)]
            return codes, said((directory / "first.log").read_text(), "disk full"), directory / "kept", undisturbed

    @fault("CUDA out of memory", "torch.cuda.OutOfMemoryError on every forward of > 2 rows (both models)")
    def _(directory):
        cache = fresh_cache(directory / "cache")
        rc, text = job([*TINY, "quant=int8", *paths(f"{directory.name}/results", cache)], directory / "job.log",
                       program=OOM_PROGRAM)
        return [rc], said(text, "out of memory"), directory / "results", undisturbed

    def disturb_child(directory: Path, how: signal.Signals, extra: list[str]) -> tuple[list[int], str, Path,
                                                                                      pd.DataFrame]:
        cache = fresh_cache(directory / "cache")
        log = directory / "job.log"
        args = [*TINY, "quant=int8", *paths(f"{directory.name}/results", cache), "runtime.threads=2",
                "runtime.reference_process=true", *extra]
        proc = start(args, log)
        pid = None
        while proc.poll() is None and pid is None:
            found = re.search(r"in a second process \(pid (\d+)", log.read_text())
            pid = int(found.group(1)) if found else None
            time.sleep(0.1)
        time.sleep(3)  # the child is computing by now
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(pid, how)
        rc = proc.wait(timeout=1800)
        return [rc], said(log.read_text(), "reference process pid"), directory / "results", undisturbed

    @fault("reference process OOM-killed", "SIGKILL to the reference's second process mid-reference")
    def _(directory):
        return disturb_child(directory, signal.SIGKILL, [])

    @fault("reference process stalled", "SIGSTOP to the reference's second process (runtime.reference_stall_s=20)")
    def _(directory):
        return disturb_child(directory, signal.SIGSTOP, ["runtime.reference_stall_s=20"])

    @fault("SIGKILL mid-evaluation", "SIGKILL of the job once 4 requests are stored; same command again")
    def _(directory):
        cache = fresh_cache(directory / "cache", like=base)
        args = [*TINY, "quant=int8", *paths(f"{directory.name}/results", cache), "eval.batch_size=1"]
        proc = start(args, directory / "first.log")
        while proc.poll() is None and checkpoint_rows(directory / "results") < 4:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        first = proc.wait()
        rc, text = job(args, directory / "second.log")
        return [first, rc], said(text), directory / "results", undisturbed

    @fault("tracking server down", "tracking.uri=http://127.0.0.1:9 (nothing listens); harness.results.sync later")
    def _(directory):
        cache = fresh_cache(directory / "cache", like=base)
        args = [*TINY, "quant=int8", *paths(f"{directory.name}/results", cache), "tracking.enabled=true",
                "tracking.uri=http://127.0.0.1:9"]
        rc, text = job(args, directory / "job.log")
        sync = subprocess.run([sys.executable, "-m", "harness.sync", str(directory / "results"),
                               f"uri=sqlite:///{directory / 'mlflow.db'}"], cwd=REPO, env=env(), capture_output=True,
                              text=True, timeout=600)
        return [rc, sync.returncode], said(text, "MLflow|TRACKING"), directory / "results", undisturbed

    @fault("stale lock", "reference lease of a dead process on this host left in the cache")
    def _(directory):
        cache = fresh_cache(directory / "cache")
        args = [*TINY, "quant=int8", *paths(f"{directory.name}/results", cache)]
        key = reference_key_of(args)
        dead = subprocess.Popen(["true"])
        dead.wait()
        (cache / "reference").mkdir()
        (cache / "reference" / f"{key}.lease").write_text(json.dumps(
            {"host": socket.gethostname(), "pid": dead.pid, "started": time.time(), "token": "dead"}))
        rc, text = job(args, directory / "job.log")
        return [rc], said(text, "stale"), directory / "results", undisturbed

    @fault("reference owner dies", "another live process holds the reference lease, then is SIGKILLed")
    def _(directory):
        cache = fresh_cache(directory / "cache")
        args = [*TINY, "quant=int8", *paths(f"{directory.name}/results", cache)]
        lease = cache / "reference" / f"{reference_key_of(args)}.lease"
        holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom harness.infra.locks import OwnedLock\n"
                                   f"OwnedLock({str(lease)!r}).acquire()\nprint('held', flush=True)\ntime.sleep(3600)"],
                                  cwd=REPO, env=env(), stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
        log = directory / "job.log"
        proc = start(args, log)
        while proc.poll() is None and "another job is computing it" not in log.read_text():
            time.sleep(0.1)
        time.sleep(2)
        holder.kill()
        holder.wait()
        rc = proc.wait(timeout=1800)
        return [rc], said(log.read_text(), "ended without finishing|stale"), directory / "results", undisturbed

    save()
    print("\n| fault | injected | exit | the user saw | recomputed | items lost |")
    print("|---|---|---|---|---|---|")
    for o in outcomes:
        print(f"| {o.fault} | {o.injected} | {', '.join(map(str, o.exit_codes))} | {o.message[:150]} | "
              f"{o.recomputed} | {o.items_lost} of {o.items} |")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(o.items_lost == 0 for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
