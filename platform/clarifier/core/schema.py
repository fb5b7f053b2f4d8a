"""The records Clarifier reads and writes: conversation logs, examples, serving request/response.

Two input shapes are accepted by the data job (see README "Data formats"):

* **Example** -- the evaluation-set format of the product contract: one user turn to decide on,
  with its prior ``history``, optional ``passages`` and the gold decision, question and grounding.
* **ConversationLog** -- a whole conversation; every user turn that carries a ``label`` becomes one
  Example whose history is the turns before it. Its passages are the turn's own ``passages`` (what
  retrieval returned for that turn) when the turn has them, else the conversation's ``passages``;
  a turn's ``meta`` is merged over the conversation's ``meta``.

Everything here is pure pydantic: no Ray, no MLflow.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

Role = Literal["user", "assistant", "system"]


def _not_blank_query(v: str) -> str:
    if not v.strip():
        raise ValueError("query is empty")
    return v


class Turn(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(extra="ignore")

    role: Role
    text: str


class Passage(BaseModel):
    """A retrieved passage shown with the query; ``id`` is what grounding refers to."""

    model_config = ConfigDict(extra="ignore")

    id: str
    text: str
    score: float | None = Field(
        None, strict=True, allow_inf_nan=False,
        description="The retriever's score of this passage (optional; higher is more relevant, any scale). Kept in "
                    "the request log and data so the score profile can be measured on a team's own turns "
                    "(clarifier.core.retrieval); the shipped decision does not read it.")

    @model_serializer(mode="wrap")
    def _drop_absent_score(self, handler):
        # A passage without a score serialises as before the field existed: sets keep their fingerprints.
        out = handler(self)
        if isinstance(out, dict) and out.get("score") is None:
            out.pop("score", None)
        return out


class Example(BaseModel):
    """One decision point: the evaluation-set format (``../shared/README.md``), unknown keys ignored."""

    model_config = ConfigDict(extra="ignore")

    id: str
    history: list[Turn] = Field(default_factory=list)
    query: str
    needs_clarification: bool
    clarifying_question: str | None = None
    grounding_turns: list[int] = Field(default_factory=list)
    grounding_passages: list[str] = Field(default_factory=list)
    passages: list[Passage] = Field(default_factory=list)
    meta: dict[str, Any] = Field(default_factory=dict)
    decision_only: bool = Field(
        False, description="A positive whose decision is known but whose question is not (e.g. the user "
                           "reformulated after a silent answer): trained and scored on the decision only.")

    _query_not_blank = field_validator("query")(_not_blank_query)

    @model_validator(mode="after")
    def _consistent(self) -> "Example":
        if self.decision_only:
            if not self.needs_clarification:
                raise ValueError("decision_only is for positives: needs_clarification must be true")
            if (self.clarifying_question or "").strip() or self.grounding_turns or self.grounding_passages:
                raise ValueError("a decision_only example has no clarifying_question or grounding")
            self.clarifying_question = None
        elif self.needs_clarification and not (self.clarifying_question or "").strip():
            raise ValueError("needs_clarification is true but clarifying_question is empty "
                             "(set decision_only: true for a positive without a question)")
        if not self.needs_clarification:
            # The contract says the question is null for clear turns; tolerate and drop a stray one.
            self.clarifying_question = None
        bad = [i for i in self.grounding_turns if i < 0 or i >= len(self.history)]
        if bad:
            raise ValueError(
                f"grounding_turns {bad} point outside history (history has {len(self.history)} turns)"
            )
        ids = {p.id for p in self.passages}
        missing = [p for p in self.grounding_passages if p not in ids]
        if missing:
            raise ValueError(f"grounding_passages {missing} are not ids of the example's passages")
        return self

    @property
    def conversation_id(self) -> str:
        """The conversation this example came from (used to split without leakage)."""
        return str(self.meta.get("conversation_id") or self.id)


class TurnLabel(BaseModel):
    """Gold annotation on a user turn of a conversation log."""

    model_config = ConfigDict(extra="ignore")

    needs_clarification: bool
    clarifying_question: str | None = None
    grounding_turns: list[int] = Field(default_factory=list)
    grounding_passages: list[str] = Field(default_factory=list)
    decision_only: bool = False  # see Example.decision_only


class LogTurn(Turn):
    """A turn of a conversation log; only user turns may carry ``label``, ``passages`` or ``meta``."""

    label: TurnLabel | None = None
    passages: list[Passage] | None = Field(
        None, description="Passages retrieved for this user turn; None (absent) = the conversation's passages.")
    meta: dict[str, Any] | None = Field(
        None, description="Per-turn metadata, merged over the conversation's meta in this turn's example.")


class ConversationLog(BaseModel):
    """A logged conversation; labelled user turns become examples (see ``explode``)."""

    model_config = ConfigDict(extra="ignore")

    conversation_id: str
    domain: str | None = None
    turns: list[LogTurn]
    passages: list[Passage] = Field(default_factory=list)
    meta: dict[str, Any] = Field(default_factory=dict)

    @field_validator("turns")
    @classmethod
    def _has_turns(cls, v: list[LogTurn]) -> list[LogTurn]:
        if not v:
            raise ValueError("conversation has no turns")
        return v

    @model_validator(mode="after")
    def _per_turn_fields_on_user_turns(self) -> "ConversationLog":
        for i, t in enumerate(self.turns):
            extra = [k for k in ("passages", "meta") if getattr(t, k)]  # empty ones say nothing: tolerated
            if extra and t.role != "user":
                raise ValueError(f"turns[{i}]: only user turns can carry {' and '.join(extra)} (role is {t.role!r})")
        return self

    def turn_passages(self, i: int) -> list[Passage]:
        """The passages shown with user turn ``i``: its own, else the conversation's."""
        own = self.turns[i].passages
        return list(own) if own is not None else list(self.passages)

    def turn_meta(self, i: int) -> dict[str, Any]:
        """The meta of turn ``i``'s example: the conversation's, the turn's over it, then
        ``conversation_id``, ``turn_index`` and ``domain`` (when the log has one)."""
        meta = {**self.meta, **(self.turns[i].meta or {})}
        meta.update({"conversation_id": self.conversation_id, "turn_index": i})
        if self.domain:
            meta["domain"] = self.domain
        return meta

    def explode(self) -> list[Example]:
        """One Example per labelled user turn; raises ValueError naming the turn on bad labels."""
        out: list[Example] = []
        for i, turn in enumerate(self.turns):
            if turn.label is None:
                continue
            if turn.role != "user":
                raise ValueError(f"turn {i}: only user turns can carry a label (role is {turn.role!r})")
            try:
                out.append(
                    Example(
                        id=f"{self.conversation_id}:{i}",
                        history=[Turn(role=t.role, text=t.text) for t in self.turns[:i]],
                        query=turn.text,
                        passages=self.turn_passages(i),
                        meta=self.turn_meta(i),
                        **turn.label.model_dump(),
                    )
                )
            except ValueError as exc:  # pydantic.ValidationError is a ValueError
                raise ValueError(f"turn {i}: {_first_error(exc)}") from exc
        return out


def _first_error(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        errs = errors()
        if errs:
            e = errs[0]
            loc = ".".join(str(x) for x in e.get("loc", ())) or "record"
            return f"{loc}: {e.get('msg')}"
    return str(exc)


def describe_validation_error(exc: Exception) -> str:
    """A one-line, human-readable reason from a pydantic error (used for quarantine reasons)."""
    return _first_error(exc)


# ---- serving API -----------------------------------------------------------------------------


class ClarifyRequest(BaseModel):
    """Body of ``POST /v1/clarify``."""

    model_config = ConfigDict(extra="forbid")

    history: list[Turn] = Field(default_factory=list)
    # The document says what the validator enforces: at least one non-whitespace character.
    query: str = Field(min_length=1, json_schema_extra={"pattern": r"\S"})
    passages: list[Passage] = Field(default_factory=list)
    conversation_id: str | None = Field(
        None, min_length=1, max_length=256,
        description="The client's id of the conversation (optional): the request log (serve.request_log) groups "
                    "a conversation's requests by it; it does not change the answer.")
    model: str | None = Field(
        None, min_length=1, max_length=128,
        description="A multi-tenant deployment (serve.tenants_file): the tenant's model that answers (also the "
                    "X-Clarifier-Model header; a key scoped to a tenant needs neither). Ignored by a single-model one.")

    _query_not_blank = field_validator("query")(_not_blank_query)


class Grounding(BaseModel):
    turns: list[int] = Field(default_factory=list)
    passages: list[str] = Field(default_factory=list)


class Usage(BaseModel):
    """Tokens one answer cost: ``prompt_tokens`` read by the decision pass (prompt + ``decision:``),
    ``completion_tokens`` generated after it (0 when no question is asked)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ClarifyResponse(BaseModel):
    """Answer of ``POST /v1/clarify``."""

    needs_clarification: bool
    confidence: float = Field(description="Model probability that the turn needs clarification.")
    threshold: float | None = Field(
        default=None,
        description="The decision threshold of the model that answered: it asks when confidence >= threshold "
                    "(and the generation parsed, see valid_output).",
    )
    question: str | None = None
    grounding: Grounding = Field(default_factory=Grounding)
    model_version: str
    valid_output: bool = Field(
        default=True,
        description="False when the generation did not parse; the answer then falls back to no clarification.",
    )
    usage: Usage | None = Field(default=None, description="Tokens read and generated for this answer.")


def source_of(example: "Example") -> str:
    """The source an example came from: ``meta.source`` (data.sources, synthetic), else ``meta.dataset``
    (the importers), else "unknown" (a user's evaluation file without either)."""
    return str(example.meta.get("source") or example.meta.get("dataset") or "unknown")


def sample_by_source(examples: list, per_source: int, seed: int, clarify_share: float | None = None) -> list:
    """Up to ``per_source`` examples of every source (:func:`source_of`; seeded), in id order.

    With ``clarify_share``, each source's sample holds that share of turns needing clarification
    where the split has enough of them (the rest clear turns; a shortfall of either is filled with
    the other), so that recall is measured on more than a handful of positives.
    """
    import random

    by: dict[str, list] = {}
    for e in sorted(examples, key=lambda e: e.id):
        by.setdefault(source_of(e), []).append(e)
    out = []
    for src in sorted(by):
        group = by[src]
        rng = random.Random(f"{seed}:{src}")
        if len(group) <= per_source:
            pass
        elif clarify_share is None:
            group = rng.sample(group, per_source)
        else:
            pos = [e for e in group if e.needs_clarification]
            neg = [e for e in group if not e.needs_clarification]
            n_pos = min(len(pos), round(clarify_share * per_source))
            n_neg = min(len(neg), per_source - n_pos)
            n_pos = min(len(pos), per_source - n_neg)
            group = rng.sample(pos, n_pos) + rng.sample(neg, n_neg)
        out += sorted(group, key=lambda e: e.id)
    return out
