"""A tiny verifiers v1 environment for the producer's tests, run offline for real: a taskset (`TinyTaskset`:
say a word back, reward 1.0 when the reply holds it), verifiers' own single-agent env and chat harness (its
program runs as a `uv` script in a subprocess runtime), and a byte-level tokenizer built with `tokenizers`
(no download). The model is `demos/standin_inference.py`'s `/inference/v1/generate`, a stand-in speaking vLLM's
token-in/token-out protocol.

verifiers resolves a taskset by id as a top-level module: ours is `tests/vf_envs/rollbuf_tiny_vf.py`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
"""Token ids 256, 257, 258: after the 256 byte tokens (id = byte value)."""
END = 258
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TASKSET_ID = "rollbuf_tiny_vf"
"""verifiers imports a taskset by id as a top-level module: `tests/vf_envs/rollbuf_tiny_vf.py` (importable once
`ENVS_DIR` is on sys.path / PYTHONPATH: `offline_environ`)."""
ENVS_DIR = Path(__file__).resolve().parent / "vf_envs"


def byte_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table (what `tokenizers`' ByteLevel pre-tokenizer maps bytes to)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def build_tokenizer(directory: Path) -> Path:
    """A byte-level BPE tokenizer with no merges (token id = byte value, then the chat specials), saved as a
    Hugging Face tokenizer directory that `transformers.AutoTokenizer` and verifiers' renderers load."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    table = byte_unicode()
    vocab = {table[b]: b for b in range(256)}
    for i, s in enumerate(SPECIALS):
        vocab[s] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def encode(text: str) -> list[int]:
    """What the tokenizer gives for plain text: one id per UTF-8 byte."""
    return list(text.encode())


def prompt_ids(prompt: str) -> list[int]:
    """The rendered prompt of a one-user-message chat, as the template writes it (generation prompt added)."""
    return [257, *encode(f"user\n{prompt}"), 258, *encode("\n"), 257, *encode("assistant\n")]


def env_config_data(harness: str = "null") -> dict[str, Any]:
    """The env config (as `serve_env`'s `config_data`): the tiny taskset, one agent on verifiers' chat harness
    in a local subprocess runtime."""
    return {
        "taskset": {"id": TASKSET_ID},
        "agent": {"harness": {"id": harness}, "runtime": {"type": "subprocess"}},
    }


def client_config(base_url: str, tokenizer: Path) -> dict[str, Any]:
    """verifiers' train client on the stand-in: `/inference/v1/generate` with our tokenizer's renderer."""
    return {
        "type": "train",
        "base_url": base_url,
        "api_key_var": "ROLLBUF_FAKE_KEY",
        "renderer_model_name": str(tokenizer),
        "renderer": {"name": "default"},
    }


WHEELHOUSE = Path(os.environ.get("ROLLBUF_WHEELHOUSE", Path(__file__).resolve().parents[1] / ".venv" / "wheelhouse"))
"""The harness's offline index, built by `make install` (`python -m rollout_client.verifiers.wheelhouse`)."""


def offline_environ(wheelhouse: Path = WHEELHOUSE) -> dict[str, str]:
    """What the harness's `uv sync --script` needs to run with no network: the local index (`make install`
    builds it), no Python downloads, `uv` on PATH (the `verifiers` extra installs it in the venv), and our
    taskset importable in verifiers' worker processes."""
    simple = wheelhouse / "simple"
    if not (simple / "index.html").is_file():
        raise RuntimeError(
            f"no offline index at {simple}: `make install` builds it (python -m rollout_client.verifiers.wheelhouse)"
        )
    path = os.environ.get("PYTHONPATH", "")
    return {
        "UV_DEFAULT_INDEX": simple.resolve().as_uri(),
        "UV_PYTHON_DOWNLOADS": "never",
        "UV_COMPILE_BYTECODE": "1",  # each rollout's harness process imports openai & co. (0.8 s of CPU, not 1.4)
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        "PYTHONPATH": f"{ENVS_DIR}:{path}" if path else str(ENVS_DIR),
    }
