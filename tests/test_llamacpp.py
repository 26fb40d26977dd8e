"""The llama.cpp tier: a REAL llama-cpp-python server (``.venv-llamacpp``) over loopback, serving the tiny random
llama exported to GGUF by ``python -m harness.export format=gguf`` and quantized by llama.cpp's own quantizer.

* the Q8_0 export is llama.cpp's Q8_0 (its tensors' types, read back) and its tokens were checked by llama.cpp;
* the served F32 file's echoed log-probs, read back position by position through the llama.cpp engine's layout
  (:mod:`harness.engines.llamacpp`), equal the in-process reference's (torch) at every position they cover, and the
  positions left out are exactly the first and the BOS ones; the top-k partition KL of F32 < Q8_0 < Q4_0 (more
  bits, less error), against the same torch reference;
* a job with the Q8_0 file as ``candidate.serve`` answers and pairs every item (generation and multiple choice)
  and measures the token divergence as the top-k bound; on the F32 file (the reference's own weights on llama.cpp)
  every greedy reply is the reference's;
* prompts without a leading BOS (``model.chat_template=false``): generation items are answered and the divergence
  is replaced by one line saying why; a multiple-choice item ends the job in one line.

Skipped without .venv-llamacpp (``bash scripts/llamacpp_venv.sh``) unless HARNESS_REQUIRE_SYSTEM_TESTS=1.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from harness.cli import compose_run
from harness.config import CandidateConfig
from harness.divergence.scoring import ServedText, score_reference
from harness.divergence.topk_bound import NoPromptLogprobs, served_rows
from harness.engines.llamacpp import LlamaCppServe
from harness.engines.openai_http import EndpointError
from harness.job import pipeline as run_mod
from tests.conftest import require_venv

REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("HARNESS_LLAMACPP_VENV", REPO / ".venv-llamacpp"))
PYTHON = VENV / "bin" / "python"
ITEMS = ["model=tiny_random", "model.max_length=1024", "slices=[math]", "slices.math.n_items=3",
         "eval.max_gen_toks=8", "slices.math.divergence_texts=2"]

pytestmark = pytest.mark.slow


def serve_command(gguf: Path, n_ctx: int = 1024) -> str:
    """llama-cpp-python's server on loopback, one thread (the tier shares 2 cores), quiet, with a float32 KV cache
    (type 0; its default F16 cache moves log-probs by ~1e-3, which would hide the float32 floor)."""
    return (f"{PYTHON} -m llama_cpp.server --model {gguf} --host 127.0.0.1 --port {{port}} --n_ctx {n_ctx} "
            "--n_threads 1 --n_threads_batch 1 --type_k 0 --type_v 0 --verbose false")


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory, shared_model_cache):
    """The tiny model exported by the CLI as F32 and Q8_0 (by llama.cpp's quantizer), and the F32 file quantized
    to Q4_0 by the same quantizer call (no second model load)."""
    from harness.checkpoint.export_gguf import quantize

    require_venv(PYTHON, "llama.cpp", "scripts/llamacpp_venv.sh")
    root = tmp_path_factory.mktemp("llamacpp")
    (root / "cache").mkdir()
    (root / "cache" / "models").symlink_to(shared_model_cache)
    out, printed = {}, {}
    for kind in ("F32", "Q8_0"):
        out[kind] = root / f"tiny_{kind.lower()}.gguf"
        done = subprocess.run([sys.executable, "-m", "harness.export", "format=gguf", "model=tiny_random",
                               f"gguf_type={kind}", f"out={out[kind]}", f"paths.cache_dir={root / 'cache'}"],
                              cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-2000:]
        printed[kind] = done.stdout
    out["Q4_0"] = root / "tiny_q4_0.gguf"
    quantize(out["F32"], out["Q4_0"], "Q4_0", threads=1)
    return out, printed, root / "cache"


@pytest.fixture(scope="module")
def reference(ggufs):
    from harness.models.loading import load

    _, _, cache = ggufs
    cfg = compose_run(["model=tiny_random", f"paths.cache_dir={cache}"])
    return load(cfg.model, cfg.paths.cache_dir)


def test_the_q8_0_export_is_llamacpps_q8_0_with_the_references_tokens(ggufs):
    import gguf

    paths, printed, _ = ggufs
    types = {tensor.name: tensor.tensor_type.name for tensor in gguf.GGUFReader(str(paths["Q8_0"])).tensors}
    matrices = [name for name in types if not name.endswith("norm.weight")]
    assert matrices and all(types[name] == "Q8_0" for name in matrices)  # every row is a multiple of 32 here
    assert all(types[name] == "F32" for name in types if name.endswith("norm.weight"))
    for kind in ("F32", "Q8_0"):
        assert "llama.cpp's tokens equal the reference's on 3 probe texts" in printed[kind]


def _texts(tokenizer) -> list[list[int]]:
    """Two chat-templated texts (each starts with SmolLM2's BOS, <|im_start|>, and holds more of them)."""
    turns = [[{"role": "user", "content": "What is 12 plus 30?"}, {"role": "assistant", "content": "42, I think."}],
             [{"role": "user", "content": "Quelle est la capitale de la France ? Ünïcödé 😀"}]]
    return [list(tokenizer.apply_chat_template(turn, tokenize=True, return_dict=False)) for turn in turns]


def _served(gguf: Path, tmp_path: Path, texts: list[list[int]], tokenizer, k: int = 5):
    engine = LlamaCppServe(CandidateConfig(serve=serve_command(gguf)), tmp_path / gguf.stem)
    with engine:
        return engine.prompt_logprobs(texts, k, tokenizer)


def test_served_echo_logprobs_are_the_references_at_every_position_they_cover(ggufs, reference, tmp_path):
    paths, _, _ = ggufs
    tokenizer, model = reference.tokenizer, reference.model
    texts = _texts(tokenizer)
    served = _served(paths["F32"], tmp_path, texts, tokenizer)
    bos = tokenizer.bos_token_id
    for ids, answer in zip(texts, served):
        assert ids[0] == bos and ids.count(bos) > 1
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), dim=-1)
        expected = logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()
        missing = np.isnan(answer.target_logprobs)
        # no entry for the first scored position (nulled, as position 0 in the OpenAI API) nor any BOS token
        assert missing.tolist() == [p == 1 or ids[p] == bos for p in range(1, len(ids))]
        np.testing.assert_allclose(answer.target_logprobs[~missing], expected[~missing], atol=2e-4, rtol=0)
        # the top cells are the reference's top tokens with their log-probs
        rows = np.flatnonzero(~missing)
        best = logp.argmax(-1).numpy()
        for row in rows:
            named = dict(zip(answer.top_ids[row].tolist(), answer.top_logprobs[row].tolist()))
            if best[row] in named:
                assert abs(named[best[row]] - float(logp[row, best[row]])) < 2e-4
        assert np.mean([best[row] in answer.top_ids[row] for row in rows]) > 0.9  # some texts have no unique id
    with pytest.raises(NoPromptLogprobs, match="start with BOS"):
        _served(paths["F32"], tmp_path, [texts[0][1:]], tokenizer)


def test_the_kl_bound_grows_as_llamacpp_keeps_fewer_bits(ggufs, reference, tmp_path):
    paths, _, _ = ggufs
    texts = _texts(reference.tokenizer)
    refs = score_reference(reference.model, reference.tokenizer, [ServedText(tuple(ids), ()) for ids in texts],
                           max_tokens=1024)
    kl = {}
    for kind in ("F32", "Q8_0", "Q4_0"):
        served = _served(paths[kind], tmp_path, texts, reference.tokenizer, k=20)
        rows = pd.concat([served_rows(ref, answer, "t", i).dropna(subset=["nll_quant"])
                          for i, (ref, answer) in enumerate(zip(refs, served))])
        kl[kind] = float(rows["kl"].mean())
    assert kl["F32"] < kl["Q8_0"] < kl["Q4_0"], kl


def _job(make_cfg, gguf: Path, *extra: str):
    return make_cfg(*ITEMS, "quant=external", f"candidate.serve='{serve_command(gguf)}'", *extra)


def _results(tmp_path: Path) -> Path:
    (results_dir,) = [d for d in (tmp_path / "results").iterdir() if (d / "summary.json").exists()]
    return results_dir


def test_a_q8_0_candidate_on_llamacpp_answers_and_pairs_every_item(ggufs, make_cfg, tmp_path):
    paths, _, _ = ggufs
    result = run_mod.run(_job(make_cfg, paths["Q8_0"], "model.chat_template=true",
                              "slices.math.tasks=[harness_math_gen,harness_math_mc]"))
    results_dir = _results(tmp_path)
    items = pd.read_parquet(results_dir / "items.parquet")
    assert set(items["output_type"]) == {"generate_until", "multiple_choice"} and len(items) == 6
    assert items["response_quant"].notna().all()
    candidate = result["candidate"]
    assert candidate["candidate.method"] == "served" and "top-" in candidate["candidate.divergence"]
    tokens = pd.read_parquet(results_dir / "tokens.parquet")
    assert len(tokens) and (tokens["kl_bound"] == "topk_partition").all() and tokens["kl"].notna().all()
    assert tokens["kl"].mean() > 0  # quantized: the served distribution differs from the reference's
    assert "math/kl_lower_bound_mean" in result["metrics"]


def test_the_references_own_weights_on_llamacpp_reply_as_the_reference(ggufs, make_cfg, tmp_path):
    # greedy on both sides (the server's default repeat_penalty 1.1 would change a random model's repetitive replies)
    paths, _, _ = ggufs
    run_mod.run(_job(make_cfg, paths["F32"], "model.chat_template=true", "candidate.endpoint_divergence_topk=0"))
    items = pd.read_parquet(_results(tmp_path) / "items.parquet")
    assert len(items) == 3 and (items["response_quant"] == items["response_ref"]).all()


def test_prompts_without_a_leading_bos_say_what_is_missing_in_one_line(ggufs, make_cfg, tmp_path):
    paths, _, _ = ggufs
    result = run_mod.run(_job(make_cfg, paths["Q8_0"], "model.chat_template=false"))
    line = result["candidate"]["candidate.divergence"]
    assert "start with BOS" in line and "\n" not in line
    assert pd.read_parquet(_results(tmp_path) / "items.parquet")["response_quant"].notna().all()
    with pytest.raises(EndpointError, match="cannot score log-likelihood items") as err:
        run_mod.run(_job(make_cfg, paths["Q8_0"], "model.chat_template=false", "slices.math.tasks=[harness_math_mc]",
                         "force=true"))
    assert "\n" not in str(err.value)
