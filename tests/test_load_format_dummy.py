"""`--load-format` with vLLM's meanings: auto and safetensors read the directory's weights,
dummy builds random weights of the config's shapes on the device as vLLM's dummy loader
fills them (every floating tensor uniform in [-1e-3, 1e-3] from a generator seeded 1234), so
a server starts from a directory holding only config.json and the tokenizer; vLLM's other
formats are refused with the reason, exit 2. The dummy server's greedy answer equals HF's
generate on the same dummy weights built in this process."""

from __future__ import annotations

import json
import random
import shutil
from types import SimpleNamespace

import openai
import pytest
import serve_fixtures as sf
import torch

from moelora.cli import build_parser
from moelora.errors import ConfigError
from moelora.hf import toy
from moelora.serve.model_dir import DUMMY_RANGE, LoadFormat, ServeSettings, dummy_model, preflight

pytestmark = pytest.mark.filterwarnings("ignore")

# (id, --load-format value, accepted, words of the refusal): which edge it covers
FORMATS = [
    ("auto", "auto", True, None),  # the default: the directory's weights
    ("safetensors", "safetensors", True, None),  # only .safetensors files
    ("dummy", "dummy", True, None),  # random weights, no weight file read
    ("pt", "pt", False, ".bin checkpoint"),  # served by auto: the reason says so
    ("gguf", "gguf", False, "GGUF"),  # a format with no reader here
    ("bitsandbytes", "bitsandbytes", False, "bitsandbytes"),  # a quantization, not served
    ("unknown", "safetensor", False, "not a load format"),  # a typo
]


@pytest.mark.parametrize("case", FORMATS, ids=[c[0] for c in FORMATS])
def test_load_formats_are_served_or_refused_with_the_reason(case, capsys):
    _, value, accepted, words = case
    argv = ["serve", "model-dir", "--load-format", value]
    if accepted:
        assert build_parser().parse_args(argv).load_format == value
        return
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--load-format" in err and words in err, err


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_seed):
    """The servers' tiny model saved whole (weights included), and its word tokenizer."""
    root = tmp_path_factory.mktemp("dummy")
    base = toy.build_model("qwen3_moe", seed=model_seed, max_position_embeddings=64)
    base.save_pretrained(root / "model")
    tokenizer = sf.word_tokenizer(base.config.vocab_size)
    tokenizer.save_pretrained(root / "model")
    return SimpleNamespace(root=root, base=base, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def bare(served):
    """The model directory without its weights: config.json and the tokenizer's files."""
    root = served.root / "bare"
    root.mkdir()
    for f in (served.root / "model").iterdir():
        if f.name == "config.json" or f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, root / f.name)
    assert not [f for f in root.iterdir() if f.suffix in (".safetensors", ".bin", ".pt")]
    return root


def test_dummy_weights_have_the_models_shapes_and_vllms_values(served, bare):
    out = dummy_model(bare, "cpu", torch.float32)
    again = dummy_model(bare, "cpu", torch.float32)
    ref = served.base.state_dict()  # the same config's real model: the shapes to have
    low, high = DUMMY_RANGE
    for name, tensor in out.state_dict().items():
        assert tensor.shape == ref[name].shape, name
        assert tensor.dtype == torch.float32 and bool(((tensor >= low) & (tensor <= high)).all())
        assert torch.equal(tensor, again.state_dict()[name]), name  # seeded per tensor
        assert tensor.numel() < 4 or tensor.std() > 0, name  # filled, not left at a constant


def test_dummy_refuses_an_fp8_config(bare, tmp_path):
    config = json.loads((bare / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"quantization_config": {
        "quant_method": "fp8", "activation_scheme": "dynamic"}}))  # fmt: skip
    with pytest.raises(ConfigError) as err:
        preflight(ServeSettings(model=tmp_path, load_format=LoadFormat.DUMMY))
    assert "--load-format" in str(err.value) and "FP8" in str(err.value)


def test_a_dummy_server_starts_from_config_and_tokenizer_and_answers(served, bare, seed):
    server = sf.start([str(bare), "--served-model-name", "dummy", "--load-format", "dummy",
                       "--moe-backend", "reference"], served.root / "dummy.log")  # fmt: skip
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
        rng = random.Random(seed)
        prompt = " ".join(f"w{rng.randrange(1, 96)}" for _ in range(5))
        out = client.completions.create(model="dummy", prompt=prompt, max_tokens=4,
                                        temperature=0)  # fmt: skip
    finally:
        assert server.stop() == 0, server.log.read_text()
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    model = dummy_model(bare, "cpu", torch.float32).eval()  # vLLM's rule: the same weights
    model.generation_config.eos_token_id = None
    ids = torch.tensor([served.tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=4, min_new_tokens=4, pad_token_id=0)  # fmt: skip
    new = ref[0, ids.shape[1] :]  # the server's text, as every completion's, skips <pad>
    assert out.choices[0].text == served.tokenizer.decode(new, skip_special_tokens=True)
