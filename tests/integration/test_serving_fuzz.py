"""Schemathesis fuzzing of the HTTP API from the running app's own OpenAPI document (issue 8).

The schema is loaded from ``/openapi.json`` of a real local Serve deployment (tiny model, every
request on the generation path, API keys on). Every operation in the document is exercised by
schemathesis' phases (the document's examples, coverage of boundary values, then generated
positive and negative requests) with at most ``MAX_EXAMPLES`` generated cases each,
deterministically (``deterministic``, no example database), over loopback only, with a valid key.
Checked on each answer: no 5xx, the status code is documented, the content type and the JSON
body match the document, valid data is accepted (2xx, or 413 for the configured size limits the
document cannot express), invalid data is rejected with a 4xx, and the operations the document
says need a key refuse requests without one. The outcome is recorded with the ``reliability``
fixture.

The run goes through schemathesis' engine (what ``st run`` drives) from inside one test, because
the schema only exists once the server fixture is up, and schemathesis' lazy pytest loader
(``schemathesis.pytest.from_fixture``) does not work with pytest 9.2's node ids.
"""

from __future__ import annotations

from collections import Counter

import pytest
import schemathesis

from clarifier.core.config import ServeConfig
from clarifier.runtime.services import free_port

pytestmark = [pytest.mark.integration, pytest.mark.reliability]

KEY = "fuzz-key-2c81d0e5"
MAX_EXAMPLES = 25
# Checks that must have run (each is also a failure when it fails): schemathesis' defaults.
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_schema_conformance", "positive_data_acceptance", "negative_data_rejection",
          "ignored_auth")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from clarifier.serving.app import run_local
    from support.adapters import untrained_adapter
    from support.ray import start_ray

    # threshold 0: every answer goes through generation and the output parser, the paths odd input
    # is most likely to break; a few tokens keep each request quick
    folder = untrained_adapter(tiny_model_dir, tmp_path_factory.mktemp("fuzz") / "adapter", seed=13, threshold=0.0)
    with pytest.MonkeyPatch.context() as mp, start_ray(4):
        mp.setenv("CLARIFIER_API_KEYS", KEY)  # read by build_app, in this process
        cfg = ServeConfig(model_uri=str(folder), port=free_port(), max_new_tokens=8, cpus_per_replica=0.5)
        yield run_local(cfg, ready_timeout_s=240)


@pytest.fixture(scope="module")
def api_schema(server):
    config = schemathesis.Config.from_dict({
        "headers": {"Authorization": f"Bearer {KEY}"},
        "request-timeout": 60,
        "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none",
                       "mode": "all"},
        "checks": {
            # The configured size limits (max_history_turns, max_chars, max_batch_requests) are
            # deployment settings the document cannot express; a request over them is valid by
            # the schema and gets the documented 413.
            "positive_data_acceptance": {"expected-statuses": ["2xx", "413"]},
        },
        # Chat completions read OpenAI messages as a transcript: that the conversation ends with the
        # user's non-empty query is a documented 400 the schema cannot express.
        "operations": [{"include-path": "/v1/chat/completions",
                        "checks": {"positive_data_acceptance": {"expected-statuses": ["2xx", "400", "413"]}}}],
    })
    return schemathesis.openapi.from_url(f"{server}/openapi.json", config=config)


def run_schemathesis(schema) -> dict:
    """All of schemathesis' phases over every operation (its engine, as ``st run`` drives it)."""
    from schemathesis.engine import events, from_schema

    out: dict = {"requests": 0, "status": Counter(), "server_errors": [], "operations": set(), "failures": [],
                 "errors": [], "phases": set(), "checks": Counter(), "stop": None}
    for event in from_schema(schema).execute():
        if isinstance(event, (events.ScenarioFinished, events.FuzzScenarioFinished)):
            rec = event.recorder
            out["operations"].add(rec.label)
            out["phases"].add(str(getattr(event, "phase", "fuzzing")))
            for interaction in rec.interactions.values():
                if interaction.response is None:
                    continue
                out["requests"] += 1
                code = interaction.response.status_code
                out["status"][code] += 1
                if code >= 500:
                    out["server_errors"].append(f"{interaction.request.method} {interaction.request.uri} -> {code}")
            for checks in rec.checks.values():
                for check in checks:
                    out["checks"][check.name] += 1
                    if check.failure_info is not None:
                        f = check.failure_info.failure
                        out["failures"].append(f"{rec.label}: {check.name}: {f.title}: {f.message[:300]}\n"
                                               f"  {check.failure_info.code_sample[:600]}")
        elif isinstance(event, (events.NonFatalError, events.FatalError)):
            out["errors"].append(repr(getattr(event, "value", None) or getattr(event, "exception", None)))
        elif isinstance(event, events.EngineFinished):
            out["stop"] = str(event.stop_reason)
    return out


@pytest.mark.timeout(900)
def test_http_api_conforms_to_its_openapi_document(api_schema, reliability):
    operations = {r.ok().label for r in api_schema.get_all_operations()}
    assert {"POST /v1/clarify", "POST /v1/clarify/batch", "GET /healthz", "GET /readyz"} <= operations, operations
    res = run_schemathesis(api_schema)
    statuses = ", ".join(f"{k}: {v}" for k, v in sorted(res["status"].items()))
    print(f"\nschemathesis: {res['requests']} requests over {len(res['operations'])} operations "
          f"(phases {sorted(res['phases'])}); statuses {statuses}; {len(res['failures'])} check failures, "
          f"{len(res['errors'])} errors; stop: {res['stop']}; checks run: {dict(res['checks'])}")
    for f in res["failures"][:20]:
        print(" ", f)
    reliability(fault="schemathesis-generated HTTP requests from the app's OpenAPI document",
                injected=f"{res['requests']} requests over {len(res['operations'])} operations (examples, coverage, "
                         f"<= {MAX_EXAMPLES} generated positive and negative cases each)",
                at_risk=f"{res['requests']} requests",
                lost=f"{len(res['server_errors'])} answered 5xx; {len(res['failures'])} conformance failures",
                recovered=f"statuses {statuses}",
                time_to_recover_s=None)
    assert res["operations"] >= operations, res["operations"]
    assert set(CHECKS) <= set(res["checks"]), res["checks"]
    assert not res["errors"], res["errors"][:5]
    assert not res["server_errors"], res["server_errors"][:10]
    assert not res["failures"], "\n".join(res["failures"][:10])
    assert res["requests"] >= MAX_EXAMPLES * len(operations)
