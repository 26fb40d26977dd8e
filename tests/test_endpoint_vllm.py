"""The engine tier: a REAL ``vllm serve`` process (vLLM's CPU build in .venv-engine) over loopback.

The harness's own FP8 W8A8 export of SmolLM2 (``python -m harness.export model=smollm2_135m
quant=fp8``) is served by vLLM (kernel ``ChannelWiseTorchFP8ScaledMMLinearKernel`` on this CPU) as
the job's candidate (``quant=external candidate.serve="<vllm command with {port}>"``) on a few items
of the math slice, paired with the reference; the job starts the server and stops it. Then the server
is killed mid-slice (one line with its exit code and last log lines, the answered items kept), and a
server holding another model (a tiny random llama with its own BPE vocabulary) is refused by the
token check before any item.

Slow (each server start is ~30-70 s on 2 cores) and skipped without .venv-engine
(``bash scripts/engine_venv.sh``), unless HARNESS_REQUIRE_SYSTEM_TESTS=1 (then they fail).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from harness.evaluation import evaluate
from harness.engines.openai_http import Client, EndpointError
from harness.job import pipeline as run_mod
from tests.conftest import require_venv

REPO = Path(__file__).resolve().parents[1]
ENGINE_PYTHON = Path(os.environ.get("HARNESS_ENGINE_VENV", REPO / ".venv-engine")) / "bin" / "python"
ITEMS = ["model=smollm2_135m", "model.max_length=2048", "slices=[math]", "slices.math.n_items=2",
         "slices.math.tasks=[harness_math_gen,harness_math_mc]", "eval.max_gen_toks=8"]
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO"}

pytestmark = pytest.mark.slow


def _engine() -> None:
    require_venv(ENGINE_PYTHON, "vLLM engine", "scripts/engine_venv.sh")


def vllm_command(model_dir: Path, name: str, max_len: int = 2048) -> str:
    """``vllm serve`` through the module (the ``vllm`` script looks up a distribution named vllm; this one
    is vllm-cpu), fp32 as the harness evaluates, eager (no compile on a CPU test), loopback only."""
    return (f"{ENGINE_PYTHON} -m vllm.entrypoints.openai.api_server --model {model_dir} --served-model-name {name} "
            f"--host 127.0.0.1 --port {{port}} --dtype float32 --max-model-len {max_len} --enforce-eager")


def harness_export(tmp_path_factory, shared_model_cache, scheme: str) -> Path:
    """The harness's export of SmolLM2 under ``scheme``, as ``python -m harness.export`` writes it."""
    _engine()
    root = tmp_path_factory.mktemp("engine")
    (root / "cache").mkdir()
    os.symlink(shared_model_cache, root / "cache" / "models")
    out = root / scheme
    subprocess.run([sys.executable, "-m", "harness.export", "model=smollm2_135m", f"quant={scheme}", f"out={out}",
                    f"paths.cache_dir={root / 'cache'}"], check=True, cwd=REPO, capture_output=True)
    return out


@pytest.fixture(scope="module")
def fp8_export(tmp_path_factory, shared_model_cache):
    """The harness's FP8 W8A8 export of SmolLM2."""
    return harness_export(tmp_path_factory, shared_model_cache, "fp8")


def _engine_processes(marker: Path) -> list[int]:
    """Processes whose command line names ``marker`` (a server left running would show here)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(marker).encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def _job(make_cfg, export: Path, *extra: str):
    return make_cfg(*ITEMS, "quant=external", f"candidate.serve='{vllm_command(export, 'smollm2-fp8')}'",
                    "slices.math.divergence_texts=2", *extra)


def test_the_job_serves_the_fp8_export_with_vllm_and_pairs_every_item(make_cfg, fp8_export, tmp_path, monkeypatch):
    for name, value in ENGINE_ENV.items():
        monkeypatch.setenv(name, value)
    result = run_mod.run(_job(make_cfg, fp8_export))
    (results_dir,) = [d for d in (tmp_path / "results").iterdir() if (d / "summary.json").exists()]
    items = pd.read_parquet(results_dir / "items.parquet")
    assert set(items["output_type"]) == {"generate_until", "multiple_choice"} and len(items) == 4
    assert items["response_quant"].notna().all()
    candidate = result["candidate"]
    assert candidate["candidate.method"] == "served" and candidate["candidate.served_model"] == "smollm2-fp8"
    # read from the served checkpoint (vLLM names it in /v1/models): FP8 weights, 8 bits + an fp32 scale per row
    assert candidate["candidate.checkpoint_method"] == "compressed-tensors"
    assert candidate["candidate.format"] == "float-quantized"
    assert 8 < candidate["candidate.bits_per_weight"] < 8.1
    assert "Selected ChannelWiseTorchFP8ScaledMMLinearKernel" in (results_dir / "serve.log").read_text()
    # token divergence from vLLM's prompt log-probs (its default --max-logprobs is the harness's default k, 20)
    tokens = pd.read_parquet(results_dir / "tokens.parquet")
    assert len(tokens) and (tokens["kl_bound"] == "topk_partition").all() and (tokens["kl_cells"] >= 20).all()
    assert tokens["kl"].mean() > 0 and "math/kl_lower_bound_mean" in result["metrics"]
    assert not _engine_processes(fp8_export)  # the harness stopped the server it started


def test_vllm_killed_mid_slice_ends_the_job_in_one_line_and_keeps_the_answers(make_cfg, fp8_export, tmp_path,
                                                                            monkeypatch):
    for name, value in ENGINE_ENV.items():
        monkeypatch.setenv(name, value)
    complete, calls = Client.complete, []

    def dies_at_the_third_request(self, **body):  # the tokenizer probe, one item, then the server is killed
        calls.append(1)
        if len(calls) == 3:
            self.server.process.kill()
            self.server.process.wait()
        return complete(self, **body)

    monkeypatch.setattr(Client, "complete", dies_at_the_third_request)
    with pytest.raises(EndpointError) as err:
        run_mod.run(_job(make_cfg, fp8_export, "candidate.endpoint_batch_size=1"))
    message = str(err.value)
    assert "\n" not in message and "exited with code -9; last log lines:" in message
    assert "the same command resumes" in message
    (results_dir,) = list((tmp_path / "results").iterdir())
    kept = sum(evaluate.checkpoint_rows(prefix) for prefix in _prefixes(results_dir / "checkpoint"))
    assert kept == 1  # the one answer before the kill
    assert not _engine_processes(fp8_export)


def _prefixes(checkpoint: Path) -> list[Path]:
    return sorted({p.parent / p.name.rsplit("_rank", 1)[0] for p in checkpoint.rglob("*_rank*.db")})


def _another_model(directory: Path) -> None:
    """A tiny random llama whose BPE vocabulary (trained here on a few sentences) is not SmolLM2's."""
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tiny_models import tiny_llama

    bpe = Tokenizer(tok_models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["The quick brown fox jumps over the lazy dog. " * 3, "What is 12 plus 30? 42.",
                             "Quelle est la capitale de la France ? Paris."], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    # head_dim 64: vLLM's CPU attention has no kernel for small heads ("Unsupported CPU attention
    # configuration: head_dim=16")
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=128, heads=2, kv_heads=1, max_position_embeddings=512,
                       bos_token_id=1, eos_token_id=2)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def test_vllm_serving_another_model_is_refused_by_the_token_check(make_cfg, tmp_path, monkeypatch):
    _engine()
    for name, value in ENGINE_ENV.items():
        monkeypatch.setenv(name, value)
    other = tmp_path / "other"
    _another_model(other)
    with pytest.raises(EndpointError, match=r"tokenizer probe .*The server runs another model or tokenizer") as err:
        run_mod.run(make_cfg(*ITEMS, "quant=external", f"candidate.serve='{vllm_command(other, 'other', 512)}'"))
    assert "\n" not in str(err.value)
    assert not _engine_processes(other)
