"""The labelling page: ``clarifier label serve --queue queue.jsonl --out labels.jsonl``.

A small FastAPI app over a :class:`clarifier.data.label_store.LabelStore` (no model, no Ray: it only shows the
queued turns and writes labels), served by uvicorn on one port:

* ``GET /`` -- the page (``label.html``): the conversation with numbered turns (click a turn to mark it as the
  question's grounding), the passages, the latest message, and three keys: ``c`` needs a question, ``n`` clear,
  ``s`` skip (an optional question text; Ctrl+Enter in it labels "needs a question"); a turn that carries a
  pre-label from what happened next (a queue chosen from the serving request log, ``meta.prelabel``) shows it with
  its rule, and ``Enter`` confirms it;
* ``GET /api/next?after=ID`` -- the next turn without a label and the progress;
* ``POST /api/label`` ``{"id", "decision", "question"?, "grounding_turns"?, "session"?}`` -- appends the label
  (on disk before the answer: 200), 409 when the turn is already labelled (by another page or process), 422 on a
  bad field;
* ``GET /api/progress`` -- labelled, left, class balance, the kept-apart estimate, and how many pages labelled in
  the last two minutes (two people on one queue are told, and no turn is labelled twice).
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Optional

from fastapi import FastAPI, HTTPException
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, ConfigDict, Field

from clarifier.data.label_store import DECISIONS, LabelConflict, LabelStore

ACTIVE_S = 120  # a page that labelled within this many seconds counts as labelling now


class LabelBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1)
    decision: str = Field(description="clarify (needs a question), clear, or skip")
    question: Optional[str] = Field(None, max_length=2000)
    grounding_turns: list[int] = Field(default_factory=list)
    session: Optional[str] = Field(None, max_length=200, description="The page's id (one per browser tab).")


def label_app(store: LabelStore) -> FastAPI:
    """The page and its API over ``store``."""
    app = FastAPI(title="Clarifier labelling", docs_url=None, redoc_url=None, openapi_url=None)
    pages: dict[str, float] = {}
    page = resources.files("clarifier.serving").joinpath("label.html").read_text()

    def progress() -> dict:
        now = time.time()
        return {**store.progress(), "pages_labelling": sum(1 for t in pages.values() if now - t <= ACTIVE_S)}

    @app.get("/", response_class=HTMLResponse)
    def index() -> str:
        return page

    @app.get("/api/progress")
    def get_progress() -> dict:
        return progress()

    @app.get("/api/next")
    def get_next(after: Optional[str] = None) -> dict:
        return {"item": store.next_item(after), "progress": progress()}

    @app.post("/api/label")
    def post_label(body: LabelBody) -> dict:
        if body.decision not in DECISIONS:
            raise HTTPException(422, f"decision {body.decision!r}: one of {', '.join(DECISIONS)}")
        try:
            rec = store.add(body.id, body.decision, question=body.question, grounding_turns=body.grounding_turns,
                            session=body.session)
        except LabelConflict as exc:
            raise HTTPException(409, str(exc)) from None
        except ValueError as exc:
            raise HTTPException(422, str(exc)) from None
        if body.session:
            pages[body.session] = time.time()
        return {"ok": True, "id": rec["id"], "progress": progress()}

    return app
