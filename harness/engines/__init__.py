"""Serving engines behind one interface (:mod:`.base`) and a registry (:mod:`.registry`).

The built-in engines, one module each, register themselves when this package is imported:
``openai`` (:mod:`.openai_endpoint`, any OpenAI-compatible server: ``candidate.endpoint``; its HTTP
client is :mod:`.openai_http`), ``vllm-serve`` (:mod:`.vllm_serve`, a server the harness starts:
``candidate.serve``) and ``vllm`` (:mod:`.vllm_inprocess`, lm-eval's vLLM backend in this process:
``eval.backend=vllm``), ``llamacpp`` / ``llamacpp-serve`` (:mod:`.llamacpp`, llama-cpp-python's server of a GGUF). A served candidate in the job is :mod:`.served`; its settings are checked by
:mod:`.served_config`.
"""
from harness.engines import llamacpp, openai_endpoint, vllm_inprocess, vllm_serve  # noqa: F401 - each registers its engine
from harness.engines.base import Capabilities, Engine, InProcessEngine, ServedEngine, ServedModel
from harness.engines.registry import engine_names, get_engine, in_process_engine, register_engine, served_engine

__all__ = ["Capabilities", "Engine", "InProcessEngine", "ServedEngine", "ServedModel", "engine_names", "get_engine",
           "in_process_engine", "register_engine", "served_engine"]
