"""The served model of the server tests: a tiny random Qwen3-MoE directory with a word-level
tokenizer ("w1 w2 ...", no download) and a chat template, four PEFT-written adapters, and a
real `moelora serve` process on a free 127.0.0.1 port (stopped by SIGTERM, exit code kept)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx
import torch

from moelora.hf import toy

TESTS = Path(__file__).parent
CHAT_TEMPLATE = (
    "{% for m in messages %}w1 w{{ 2 + (m['content'] | length) % 5 }} {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}w9{% endif %}"
)


def word_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


@dataclass
class Served:
    root: Path
    base: torch.nn.Module  # never attached: HF's own model
    truths: dict  # adapter name -> PEFT model with it alone
    dirs: dict[str, Path]
    tokenizer: object


def build(root: Path, seed: int = 3, max_positions: int = 128, family: str = "qwen3_moe",
          **overrides) -> Served:  # fmt: skip
    """A tiny model of `family` (toy.build_model's overrides), its word tokenizer and the
    family's demo adapters, saved under root."""
    base = toy.build_model(family, seed=seed, max_position_embeddings=max_positions,
                           **overrides)  # fmt: skip
    base.generation_config.eos_token_id = None  # random weights: no end token, lengths fixed
    base.save_pretrained(root / "model")
    tok = word_tokenizer(base.config.vocab_size)
    tok.save_pretrained(root / "model")
    truths, dirs = {}, {}
    for i, (name, kw) in enumerate(toy.demo_adapters(base).items()):
        dirs[name] = root / name
        truths[name] = toy.write_peft_adapter(base, dirs[name], seed=seed + i + 1, **kw)
    return Served(root, base, truths, dirs, tok)


def truth_text(served: Served, adapter: str | None, prompt_ids: list[int], n: int, **kw) -> str:
    """HF + PEFT generating the prompt alone with `adapter` (a name of served.truths; any
    other name is the base model), greedy unless kw says otherwise: the new tokens' text."""
    model = served.truths.get(adapter, served.base)
    ids = torch.tensor([prompt_ids])
    kw = dict(do_sample=False) | kw
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=0, **kw)  # fmt: skip
    return served.tokenizer.decode(out[0, len(prompt_ids) :], skip_special_tokens=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path
    returncode: int | None = field(default=None)

    def stop(self, timeout: float = 60.0, sig: int = signal.SIGTERM) -> int:
        """`sig` (SIGTERM), then the exit code (killed after `timeout`: the test then fails)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.returncode = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.returncode = self.proc.wait()
        return self.returncode


def start(argv: list[str], log: Path, ready_s: float = 240.0) -> Server:
    """`moelora serve ...argv` in a child process; returns once /health answers."""
    port = free_port()
    env = os.environ | {"PYTHONPATH": str(TESTS.parent)}
    out = open(log, "w")
    cmd = [sys.executable, "-m", "moelora", "serve", *argv, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(server.url + "/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server not ready after {ready_s} s:\n{log.read_text()}")


def run_child(argv: list[str], log: Path, timeout: float = 300.0) -> int:
    """`moelora argv` in a child process; its exit code."""
    env = os.environ | {"PYTHONPATH": str(TESTS.parent)}
    with open(log, "w") as out:
        cmd = [sys.executable, "-m", "moelora", *argv]
        return subprocess.run(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout
        ).returncode
