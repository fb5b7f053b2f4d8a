"""The playground page (GET / and GET /playground of the ingress) without Ray: served from the package
data, self-contained, and carrying the element ids and request fields that its browser test
(tests/integration/test_playground.py) and the API rely on."""

from __future__ import annotations

import re
import typing

import pytest

# The ids tests/integration/test_playground.py drives and reads.
FORM_IDS = ("turns", "add-turn", "passages", "add-passage", "query", "api-key", "clarify", "load-example", "clear",
            "paste-text", "paste-apply", "error", "status")
RESULT_IDS = ("result", "decision", "confidence-bar", "confidence-fill", "threshold-marker", "confidence", "threshold",
              "question", "grounding", "transcript", "model-version", "invalid-note")


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    from clarifier.serving.ingress import fastapi_app

    # No Serve replica here: only module-level routes answer (the page is one); the request-metrics
    # middleware finds no ingress and records nothing.
    with TestClient(fastapi_app) as c:
        yield c


@pytest.mark.parametrize("path", ["/playground", "/"])
def test_page_is_served_without_a_key_as_html(client, path):
    r = client.get(path)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    html = r.text
    for i in FORM_IDS + RESULT_IDS:
        assert re.search(rf'\bid="{re.escape(i)}"', html), f"id {i!r} missing from the playground page"
    assert "Clarifier playground" in html


def test_page_is_the_package_data_file_and_self_contained():
    from importlib.resources import files

    from clarifier.serving.ingress import playground_html

    html = playground_html()
    assert html == files("clarifier.serving").joinpath("playground.html").read_text(encoding="utf-8")
    # nothing is fetched from elsewhere: no absolute or protocol-relative URL, no external resource tag
    assert not re.search(r"https?://|[\"'(]//\w", html), "the page names an external URL"
    assert not re.search(r"<(img|iframe|object|embed)\b|<script\s+[^>]*src=|<link\b(?![^>]*href=\"data:)", html, re.I)


def test_page_sends_what_the_api_takes():
    from clarifier.core.schema import ClarifyRequest, Role
    from clarifier.serving.auth import HEADER
    from clarifier.serving.ingress import MODEL_HEADER, playground_html

    html = playground_html()
    assert f'const API_KEY_HEADER = "{HEADER}";' in html
    assert f'const MODEL_HEADER = "{MODEL_HEADER}";' in html  # a tenant's model, when typed in
    roles = re.search(r"const ROLES = \[([^\]]*)\];", html).group(1)
    assert [r.strip().strip('"') for r in roles.split(",")] == list(typing.get_args(Role))
    # the request body the page builds has exactly the request's fields (but conversation_id: a try in the
    # playground is not part of a logged conversation; and model: the page sends it as a header)
    built = re.search(r"return \{history: history, query: [^,]+, passages: passages\};", html)
    assert built and set(ClarifyRequest.model_fields) - {"conversation_id", "model"} == {"history", "query", "passages"}
    # relative to the page's own path, so that it works under a route prefix
    assert 'apiBase() + "/v1/clarify"' in html and 'fetch("/' not in html


def test_page_is_left_out_of_the_openapi_document_and_counted_as_its_route():
    from starlette.requests import Request

    from clarifier.serving.ingress import _route_of, fastapi_app

    page_routes = [r for r in fastapi_app.routes if getattr(r, "path", None) in ("/", "/playground")]
    assert len(page_routes) == 2 and not any(r.include_in_schema for r in page_routes)
    for path, root in (("/playground", ""), ("/", ""), ("/clarifier/playground", "/clarifier")):
        assert _route_of(Request({"type": "http", "path": path, "root_path": root})) == "playground"
