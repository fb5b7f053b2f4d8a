"""The public API: every name resolves, lazily, and importing it loads no framework."""

import subprocess
import sys

import pytest


def test_every_public_name_resolves():
    from clarifier import api

    for name in api.__all__:
        assert getattr(api, name) is not None, name


def test_unknown_name_lists_the_public_ones():
    from clarifier import api

    with pytest.raises(AttributeError, match="public names: .*load_engine"):
        api.no_such_thing  # noqa: B018


def test_import_is_lazy():
    code = "import sys, clarifier.api; print(' '.join(m for m in ('ray', 'mlflow', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
