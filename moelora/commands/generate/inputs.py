"""What `moelora generate` reads from its flags: adapters, rows, prompts and the model
directory, each refused (exit 2, naming the flag, the value and the fix) before anything
runs (an oracle refusal's fix reaches the user in generate's own flags through
flag_terms.error_text)."""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import ConfigError


def parse_adapters(texts: list[str]) -> dict[str, Path]:
    """NAME=DIR flags -> {name: directory}; a name given twice is refused (the second
    would silently replace the first)."""
    adapters: dict[str, Path] = {}
    for text in texts:
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ConfigError("--adapter", text, "NAME=DIR", "e.g. --adapter math=./adapters/math")
        if name in adapters:
            raise ConfigError(
                "--adapter",
                text,
                f"each NAME once (NAME '{name}' is already {adapters[name]})",
                "give each adapter directory its own NAME",
            )
        adapters[name] = Path(path)
    return adapters


def parse_rows(text: str) -> list[str | None]:
    return [None if r.strip() in ("base", "none", "") else r.strip() for r in text.split(",")]


def tokenizer(model_dir: str | None, prompts: list[str]):
    """The model directory's tokenizer, or None (random models, directories without one)."""
    root = Path(model_dir) if model_dir else None
    if root is None or not any(
        (root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        if prompts:
            raise ConfigError(
                "--prompt",
                prompts[0],
                "a --model directory with a tokenizer (tokenizer.json)",
                "save the tokenizer beside the model, or leave --prompt out (random prompts)",
            )
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(root), local_files_only=True)


def prompts(texts: list[str], vocab_size: int, count: int, tok, seed: int) -> list[torch.Tensor]:
    """One prompt [S] per row: the texts tokenized (repeated to `count`), else random ids."""
    if texts:
        texts = (texts * count)[:count]
        return [torch.tensor(tok(t)["input_ids"]) for t in texts]
    gen = torch.Generator().manual_seed(seed)
    lengths = [5 + (3 * row) % 7 for row in range(count)]
    return [torch.randint(1, vocab_size, (n,), generator=gen) for n in lengths]


def check_positions(prompts: list[torch.Tensor], max_new_tokens: int, config) -> None:
    """Refuse a prompt that, with the new tokens, passes the model's max_position_embeddings
    (positions past it are not trained, or index past the rotary table)."""
    limit = getattr(config, "max_position_embeddings", None)
    if not limit:
        return
    longest = max(len(p) for p in prompts)
    if longest > limit:
        raise ConfigError(
            "--prompt",
            f"{longest} tokens",
            f"at most {limit} tokens (the model's max_position_embeddings)",
            "shorten the prompt",
        )
    if longest + max_new_tokens > limit:
        raise ConfigError(
            "--max-new-tokens",
            max_new_tokens,
            f"at most {limit - longest}: the longest prompt ({longest} tokens) plus the new "
            f"tokens must fit the model's max_position_embeddings ({limit})",
            f"--max-new-tokens {limit - longest}, or a shorter prompt",
        )


def left_padded(prompts: list[torch.Tensor], device, pad: int = 0):
    """(ids [B, S], attention mask [B, S]): the prompts right-aligned, `pad` before them."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :], mask[row, width - len(p) :] = p, 1
    return ids, mask


def load_model(path: str, dtype, device):
    from transformers import AutoModelForCausalLM

    root = Path(path)
    if not (root / "config.json").is_file():
        raise ConfigError(
            "--model", path, "a model directory with config.json", "save_pretrained one"
        )
    model = AutoModelForCausalLM.from_pretrained(str(root), dtype=dtype, local_files_only=True)
    return model.to(device).eval()
