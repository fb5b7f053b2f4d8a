"""Model URIs -> folders: folders resolve here, other schemes go to the resolver registered for them."""

import pytest

from clarifier.engine import loading
from clarifier.engine.loading import ResolvedModel, resolve_model, scheme_resolver
from clarifier.engine.models import ModelResolutionError


def test_a_folder_resolves_to_itself(tmp_path):
    assert resolve_model(str(tmp_path)) == ResolvedModel(tmp_path, str(tmp_path))


def test_a_missing_folder_names_what_is_accepted(tmp_path):
    with pytest.raises(ModelResolutionError, match=r"not a folder, s3:// prefix or builtin:/, models:/, runs:/ URI"):
        resolve_model(str(tmp_path / "nope"))


def test_unknown_scheme_says_how_to_add_one():
    with pytest.raises(ModelResolutionError, match="no resolver for model URIs hf:/.*clarifier.model_uri_schemes"):
        resolve_model("hf://org/model")


def test_registry_schemes_are_registered():
    from clarifier.registry.registry import resolve_registry_uri

    assert scheme_resolver("models") is resolve_registry_uri and scheme_resolver("runs") is resolve_registry_uri


def test_a_plugin_scheme_is_called_with_the_uri(monkeypatch, tmp_path):
    seen = {}

    def fake(uri, cache_dir=None, tracking_uri=None):
        seen.update(uri=uri, cache_dir=cache_dir, tracking_uri=tracking_uri)
        return ResolvedModel(tmp_path, "mine/1")

    monkeypatch.setitem(globals(), "_FAKE", fake)  # what an entry point "mine = <this module>:_FAKE" names
    monkeypatch.setitem(loading._schemes(), "mine", f"{__name__}:_FAKE")
    assert resolve_model("mine:/x/1", cache_dir="c", tracking_uri="t") == ResolvedModel(tmp_path, "mine/1")
    assert seen == {"uri": "mine:/x/1", "cache_dir": "c", "tracking_uri": "t"}
