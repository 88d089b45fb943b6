"""Models by hub id (engine/models/loader.py): resolution order, a mocked download, and the offline
error. Nothing here reaches the network: the hub calls are replaced, or the hub is offline."""

from __future__ import annotations

import json

import huggingface_hub
import pytest
from huggingface_hub import constants as hub_constants

from engine.llm import LLM
from engine.models import loader
from engine.models.loader import ModelNotFoundError, UnsupportedModelError, is_hub_id, resolve_model
from engine.sampling import SamplingParams
from tiny_models import make_tiny_qwen3_dir

REPO = "Qwen/Qwen3-8B"


class FakeHub:
    """Stands in for huggingface_hub's two download functions, serving one local directory."""

    def __init__(self, snapshot):
        self.snapshot = snapshot
        self.calls: list[tuple[str, dict]] = []

    def hf_hub_download(self, repo_id, filename, **kwargs):
        self.calls.append(("hf_hub_download", dict(repo_id=repo_id, filename=filename, **kwargs)))
        return str(self.snapshot / filename)

    def snapshot_download(self, repo_id, **kwargs):
        self.calls.append(("snapshot_download", dict(repo_id=repo_id, **kwargs)))
        return str(self.snapshot)

    def install(self, monkeypatch):
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", self.hf_hub_download)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", self.snapshot_download)
        return self


@pytest.fixture
def empty_hub_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def test_hub_ids_are_told_apart_from_paths_and_names():
    assert is_hub_id("Qwen/Qwen3-8B") and is_hub_id("meta-llama/Llama-3.1-8B-Instruct")
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    for spec in ("default", "a/b/c", "/abs/model", "./org/model", "org/model.gguf", "org/", "/x",
                 "org/na me", None, 3):
        assert not is_hub_id(spec), spec


def test_a_hub_id_downloads_through_huggingface_hub_and_loads(tmp_path, monkeypatch):
    snapshot = make_tiny_qwen3_dir(tmp_path, name="snapshot")
    hub = FakeHub(snapshot).install(monkeypatch)
    assert resolve_model(REPO) == snapshot
    (first, config_call), (second, snap_call) = hub.calls
    # config.json first (an unsupported architecture fails before any weights move), then the rest
    assert (first, config_call["filename"], second) == ("hf_hub_download", "config.json",
                                                        "snapshot_download")
    assert snap_call["repo_id"] == REPO and "*.safetensors" in snap_call["allow_patterns"]
    assert not any(p.endswith((".bin", ".pth", ".gguf")) for p in snap_call["allow_patterns"])
    llm = LLM(REPO, block_size=8, kv_cache_tokens=256)
    out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=4,
                                                               ignore_eos=True))[0]
    assert llm.model_dir == snapshot and out.num_output_tokens == 4


def test_an_unsupported_hub_architecture_fails_before_the_weights(tmp_path, monkeypatch):
    snapshot = tmp_path / "gpt2"
    snapshot.mkdir()
    (snapshot / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    hub = FakeHub(snapshot).install(monkeypatch)
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*'llama'.*'qwen3'"):
        resolve_model("openai-community/gpt2")
    assert [name for name, _ in hub.calls] == ["hf_hub_download"]


def test_a_local_directory_wins_over_the_hub(tmp_path, monkeypatch):
    make_tiny_qwen3_dir(tmp_path / "Qwen", name="Qwen3-8B")
    hub = FakeHub(tmp_path).install(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert resolve_model(REPO).resolve() == (tmp_path / REPO).resolve()
    assert hub.calls == []


def test_offline_and_uncached_says_how_to_pass_a_local_directory(empty_hub_cache):
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(REPO)
    message = str(info.value)
    assert REPO in message and "--model DIR" in message
    assert f"huggingface-cli download {REPO} --local-dir DIR" in message
    assert not empty_hub_cache.exists() or not any(empty_hub_cache.rglob("*.safetensors"))


def test_unreachable_hub_is_the_same_clear_error(monkeypatch):
    def unreachable(*args, **kwargs):
        raise ConnectionError("Failed to resolve 'huggingface.co'")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", unreachable)
    with pytest.raises(ModelNotFoundError, match=r"cannot be reached.*--model DIR"):
        resolve_model(REPO)


def test_a_missing_repository_is_named(monkeypatch):
    from types import SimpleNamespace

    from huggingface_hub.errors import RepositoryNotFoundError

    def missing(*args, **kwargs):
        response = SimpleNamespace(headers={}, request=None, status_code=404)  # what the error reads
        raise RepositoryNotFoundError("404 Client Error: Repository Not Found", response=response)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", missing)
    with pytest.raises(ModelNotFoundError, match=r"'nobody/no-such-model' is not a model repository"):
        resolve_model("nobody/no-such-model")
    assert loader.HUB_ID_PATTERN.match("nobody/no-such-model")
