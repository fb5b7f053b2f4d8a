"""Deterministic synthetic multi-turn conversation logs (the quickstart's training data).

Every conversation is a plain dict in the ``ConversationLog`` schema. Its last user turn is
labelled, and so are some earlier clear user turns (1-3 examples per conversation). Whether the
last turn needs a clarifying question depends on the *history*, not on the surface of the query:
the same query text ("how do I reset it?", "reset??") is generated both where two or more
candidates were named earlier (clarify, grounded on the turns that named them) and where only one
was (answer). Kinds of conversation (``meta.kind``):

* ``ambiguous`` -- several entities named earlier, the last query refers to "it" -> clarify;
* ``ambiguous_profile`` -- the *assistant* named the candidates (e.g. "I see a checking and a
  savings account on your profile"), then "it" -> clarify, grounded on the assistant turn;
* ``illformed_multi`` -- a fragment/typo query ("reset??") with several candidates -> clarify;
* ``explicit`` -- several entities named, but the query names one -> answer;
* ``single`` -- only one entity was ever named, the query says "it" -> answer;
* ``resolved`` -- two were named but the user then said which one matters -> answer;
* ``illformed_single`` -- a fragment with one candidate in context -> answer.

Only ``random.Random(seed)`` is used, so a seed always gives the same logs (and the first ``k``
of ``generate_conversations(n)`` equal ``generate_conversations(k)``).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field

__all__ = ["DOMAINS", "KINDS", "generate_conversations", "write_logs"]


@dataclass(frozen=True)
class Action:
    verb: str  # used in some clarifying questions: "Which one do you want to <verb>?"
    pronoun: tuple[str, ...]  # refers to the entity as "it"
    explicit: tuple[str, ...]  # names it: "{e}" is replaced by the entity name
    fragments: tuple[str, ...]  # ill-formed, no explicit referent


@dataclass(frozen=True)
class Domain:
    name: str
    system: str
    topic: str  # "my accounts" -- for the profile-style opening
    entities: tuple[tuple[str, tuple[str, ...]], ...]  # (name, qualifiers used when introducing it)
    problems: tuple[str, ...]  # "{e}" -> entity name
    details: tuple[str, ...]  # extra (entity-free) detail for a follow-up user turn
    tips: tuple[str, ...]  # assistant advice, "{e}" -> entity name
    actions: tuple[Action, ...]
    passages: tuple[str, ...] = field(default=())  # "{e}" -> entity name


_GENERIC_FRAGMENTS = ("the thing not working", "still broken", "not working again??", "same problem again")

DOMAINS: tuple[Domain, ...] = (
    Domain(
        name="consumer_devices",
        system="You are the support assistant of an electronics retailer.",
        topic="the devices I bought from you",
        entities=(
            ("router", ("Netgear", "TP-Link", "Asus")),
            ("modem", ("Arris", "Motorola", "Zyxel")),
            ("printer", ("HP", "Canon", "Brother")),
            ("laptop", ("Lenovo", "Dell", "Acer")),
            ("smart speaker", ("Sonos", "Echo", "Nest")),
            ("tablet", ("Samsung", "iPad", "Lenovo")),
            ("smartwatch", ("Garmin", "Fitbit", "Galaxy")),
        ),
        problems=(
            "My {q} {e} keeps dropping the connection.",
            "I have a {q} {e} that won't turn on anymore.",
            "The {q} {e} I bought last month is really slow.",
            "My {q} {e} shows a blinking orange light.",
            "Since yesterday my {q} {e} makes a clicking noise.",
        ),
        details=(
            "It started after the power cut on Sunday.",
            "I already unplugged everything and plugged it back in.",
            "It was fine until the last update.",
            "Nothing changed in my setup as far as I know.",
        ),
        tips=(
            "Sorry to hear that. Could you check whether the {e} is on the latest firmware?",
            "Thanks. A power cycle of the {e} often helps: unplug it for 30 seconds.",
            "I see. Is the {e} still under its one-year warranty?",
            "Got it. Let's look at the {e} step by step.",
        ),
        actions=(
            Action("reset", ("how do I reset it?", "can you walk me through resetting it?", "what's the fastest way to reset it?"),
                   ("how do I reset the {e}?", "can you walk me through resetting the {e}?"),
                   ("reset??", "how reset", "reset it pls")),
            Action("update", ("how do I update it?", "does it need a firmware update?"),
                   ("how do I update the {e}?", "does the {e} need a firmware update?"),
                   ("update??", "firmware?", "how 2 update")),
            Action("return", ("can I still return it?", "is it still under warranty?"),
                   ("can I still return the {e}?", "is the {e} still under warranty?"),
                   ("warranty?", "return it?", "refund??")),
            Action("fix", ("why does it keep doing that?", "can you help me fix it?"),
                   ("why does the {e} keep doing that?", "can you help me fix the {e}?"),
                   _GENERIC_FRAGMENTS),
        ),
        passages=(
            "{E} manual: hold the reset button for ten seconds until the light blinks, then wait two minutes.",
            "{E} support note: firmware updates install automatically overnight when the device is idle.",
            "Returns policy for {e}s: 30 days with receipt; the manufacturer warranty lasts one year.",
        ),
    ),
    Domain(
        name="banking",
        system="You are a virtual assistant for a retail bank.",
        topic="my accounts with you",
        entities=(
            ("checking account", ("joint", "personal", "student")),
            ("savings account", ("high-yield", "personal", "holiday")),
            ("credit card", ("Visa", "Mastercard", "travel")),
            ("mortgage", ("fixed-rate", "variable", "buy-to-let")),
            ("car loan", ("five-year", "second-hand", "new-car")),
            ("debit card", ("contactless", "personal", "business")),
        ),
        problems=(
            "I opened a {q} {e} with you last year.",
            "I have a question about my {q} {e}.",
            "There's a charge I don't recognise on my {q} {e}.",
            "I'm thinking about changing my {q} {e}.",
        ),
        details=(
            "I moved house recently, if that matters.",
            "My salary is paid in on the 25th.",
            "I mostly use online banking.",
            "I was abroad for most of last month.",
        ),
        tips=(
            "Thanks. I can help with your {e}. What would you like to know?",
            "Understood. I've pulled up the details of your {e}.",
            "Sure, your {e} is in good standing.",
            "Happy to help with the {e}.",
        ),
        actions=(
            Action("close", ("how do I close it?", "can I close it online?"),
                   ("how do I close the {e}?", "can I close the {e} online?"),
                   ("close it??", "how close", "cancel pls")),
            Action("check the fees on", ("what are the fees on it?", "how much does it cost me each month?"),
                   ("what are the fees on the {e}?", "how much does the {e} cost me each month?"),
                   ("fees??", "how much", "monthly cost?")),
            Action("check the rate of", ("what's the interest rate on it?", "has the rate on it changed?"),
                   ("what's the interest rate on the {e}?", "has the rate on the {e} changed?"),
                   ("rate?", "interest??", "wats the rate")),
            Action("look into", ("why was it charged twice?", "can you check it for me?"),
                   ("why was the {e} charged twice?", "can you check the {e} for me?"),
                   ("the thing not working", "something wrong again", "charged twice??")),
        ),
        passages=(
            "{E} terms: no monthly fee when the balance stays above 500; otherwise 4 per month.",
            "Closing a {e}: sign in, open Settings, choose Close product; pending payments must clear first.",
            "Rates for the {e} are reviewed every quarter and published on the rates page.",
        ),
    ),
    Domain(
        name="travel",
        system="You are the assistant of an online travel agency.",
        topic="my upcoming trip",
        entities=(
            ("flight to Lisbon", ("morning", "Friday", "direct")),
            ("hotel in Porto", ("three-night", "seaside", "budget")),
            ("train to Madrid", ("overnight", "first-class", "Sunday")),
            ("rental car", ("compact", "one-week", "airport")),
            ("ferry to Tangier", ("early", "return", "Saturday")),
            ("museum tour", ("guided", "afternoon", "group")),
        ),
        problems=(
            "I booked a {q} {e} through your site.",
            "I have a {q} {e} reserved for next month.",
            "My booking includes a {q} {e}.",
            "I just paid for a {q} {e}.",
        ),
        details=(
            "I'm travelling with my partner and two kids.",
            "My plans might change because of work.",
            "I paid with a credit card.",
            "It's my first time using your site.",
        ),
        tips=(
            "Thanks, I found your {e} booking.",
            "Great, the {e} is confirmed.",
            "I can see the {e} in your reservations.",
            "Noted. The {e} is booked under your name.",
        ),
        actions=(
            Action("cancel", ("can I cancel it?", "what happens if I cancel it?"),
                   ("can I cancel the {e}?", "what happens if I cancel the {e}?"),
                   ("cancel?", "cancel it??", "how cancel")),
            Action("change", ("can I change the date of it?", "is it possible to move it to a later day?"),
                   ("can I change the date of the {e}?", "is it possible to move the {e} to a later day?"),
                   ("change date?", "move it??", "diff day pls")),
            Action("get a refund for", ("is it refundable?", "how do I get my money back for it?"),
                   ("is the {e} refundable?", "how do I get my money back for the {e}?"),
                   ("refund?", "money back??", "refundable")),
            Action("get a receipt for", ("where do I find the receipt for it?", "can you email me the confirmation for it?"),
                   ("where do I find the receipt for the {e}?", "can you email me the confirmation for the {e}?"),
                   ("receipt?", "confirmation pls", "the thing not working")),
        ),
        passages=(
            "{E} conditions: free cancellation up to 48 hours before; afterwards 50% is charged.",
            "Date changes for the {e} cost a flat fee plus any fare difference.",
            "Receipts for the {e} are in My Trips; select the booking and Download invoice.",
        ),
    ),
    Domain(
        name="it_support",
        system="You are the IT helpdesk assistant of a mid-size company.",
        topic="my work setup",
        entities=(
            ("VPN client", ("Cisco", "GlobalProtect", "WireGuard")),
            ("email account", ("Outlook", "shared", "work")),
            ("password manager", ("1Password", "Bitwarden", "company")),
            ("shared drive", ("finance", "team", "project")),
            ("docking station", ("USB-C", "Dell", "Thunderbolt")),
            ("work phone", ("Android", "iPhone", "company")),
        ),
        problems=(
            "My {q} {e} stopped working this morning.",
            "I can't get into my {q} {e}.",
            "The {q} {e} keeps asking for my password.",
            "I was just given a new {q} {e}.",
        ),
        details=(
            "I'm working from home today.",
            "I changed my password on Monday.",
            "My manager said it should be set up already.",
            "I restarted my laptop twice.",
        ),
        tips=(
            "Thanks. Let's check the {e}. Do you see any error message?",
            "Understood. The {e} sometimes needs a fresh sign-in after a password change.",
            "OK, I've opened a ticket for the {e}.",
            "I can help you with the {e}.",
        ),
        actions=(
            Action("reinstall", ("how do I reinstall it?", "should I reinstall it?"),
                   ("how do I reinstall the {e}?", "should I reinstall the {e}?"),
                   ("reinstall??", "reinstal how", "reinstall pls")),
            Action("get access to", ("who can give me access to it?", "how do I request access to it?"),
                   ("who can give me access to the {e}?", "how do I request access to the {e}?"),
                   ("access??", "no access", "need acess")),
            Action("reset the password of", ("how do I reset the password for it?", "can you unlock it for me?"),
                   ("how do I reset the password for the {e}?", "can you unlock the {e} for me?"),
                   ("password??", "locked out", "unlock pls")),
            Action("fix", ("it won't let me log in, what now?", "can you help me fix it?"),
                   ("the {e} won't let me log in, what now?", "can you help me fix the {e}?"),
                   _GENERIC_FRAGMENTS),
        ),
        passages=(
            "{E} guide: uninstall from Software Center, restart, then install the approved version.",
            "Access to the {e} is granted by your manager through the access-request portal.",
            "Password resets for the {e} are self-service at the account portal; lockouts clear after 15 minutes.",
        ),
    ),
    Domain(
        name="health_insurance",
        system="You are the member-services assistant of a health insurer.",
        topic="my policies",
        entities=(
            ("dental plan", ("family", "basic", "premium")),
            ("vision plan", ("individual", "family", "basic")),
            ("hospital claim", ("March", "emergency", "outpatient")),
            ("physiotherapy claim", ("recent", "second", "April")),
            ("prescription coverage", ("generic", "extended", "standard")),
            ("travel insurance", ("annual", "single-trip", "family")),
        ),
        problems=(
            "I'm enrolled in the {q} {e}.",
            "I submitted a {q} {e} a few weeks ago.",
            "I have a question about my {q} {e}.",
            "My employer added a {q} {e} this year.",
        ),
        details=(
            "My member number is on the card you sent.",
            "I changed jobs in January.",
            "My daughter is also on my policy.",
            "I live abroad part of the year.",
        ),
        tips=(
            "Thanks, I found your {e}.",
            "Sure. The {e} is active on your membership.",
            "I can see the {e} in your file.",
            "Happy to help with the {e}.",
        ),
        actions=(
            Action("check the coverage of", ("what does it cover?", "does it cover my daughter too?"),
                   ("what does the {e} cover?", "does the {e} cover my daughter too?"),
                   ("coverage?", "covered??", "wat covered")),
            Action("check the status of", ("what's the status of it?", "when will it be paid?"),
                   ("what's the status of the {e}?", "when will the {e} be paid?"),
                   ("status?", "paid yet??", "any news")),
            Action("renew", ("when does it renew?", "how do I renew it?"),
                   ("when does the {e} renew?", "how do I renew the {e}?"),
                   ("renew??", "renewal date", "expires when")),
            Action("cancel", ("how do I cancel it?", "can I cancel it mid-year?"),
                   ("how do I cancel the {e}?", "can I cancel the {e} mid-year?"),
                   ("cancel?", "cancel it pls", "the thing not working")),
        ),
        passages=(
            "{E} summary: covers 80% after the deductible; dependants are covered when listed on the policy.",
            "Processing of a {e} takes up to 30 days; status is shown in the member app.",
            "The {e} renews on January 1 unless cancelled in writing 30 days before.",
        ),
    ),
)

KINDS: dict[str, float] = {  # final-turn kind -> sampling weight
    "ambiguous": 0.27,
    "ambiguous_profile": 0.09,
    "illformed_multi": 0.18,
    "explicit": 0.13,
    "single": 0.14,
    "resolved": 0.07,
    "illformed_single": 0.16,
}
CLARIFY_KINDS = frozenset({"ambiguous", "ambiguous_profile", "illformed_multi"})

_QUESTION_TEMPLATES_2 = (
    "Do you mean the {a} or the {b}?",
    "Which one are you asking about: the {a} or the {b}?",
    "Are you asking about the {a} or the {b}?",
    "Just to check, is this about the {a} or the {b}?",
    "Which do you want to {verb}, the {a} or the {b}?",
    "Could you tell me whether you mean the {a} or the {b}?",
)
_QUESTION_TEMPLATES_N = (
    "Do you mean the {items}?",
    "Which one are you asking about: the {items}?",
    "Which do you want to {verb}: the {items}?",
)
_BOTH_TEMPLATES = (
    "I have a {qa} {a} and a {qb} {b} from you.",
    "Both my {qa} {a} and my {qb} {b} are giving me trouble.",
    "I've got a {qa} {a} and also a {qb} {b}.",
)
_SECOND_TEMPLATES = (
    "Also, I have a {q} {e} as well.",
    "And there's my {q} {e} too.",
    "Oh, and I also have a {q} {e}.",
    "Separately, I have a {q} {e}.",
)
_RESOLVE_TEMPLATES = (
    "The {a} is fine now, it's only the {b} I'm worried about.",
    "Forget the {a}, that's sorted. Let's focus on the {b}.",
    "Never mind the {a}. My question is about the {b}.",
)
_PROFILE_REPLIES = (
    "Sure. I can see a {a} and a {b} on your profile. What would you like to know?",
    "Of course. Your profile lists a {a} and a {b}. How can I help?",
    "Happy to help. You have a {a} and a {b} with us.",
)
_PROFILE_REPLIES_N = (
    "Sure. I can see {items} on your profile. What would you like to know?",
    "Of course. Your profile lists {items}. How can I help?",
)
_OPENERS = ("I have a question about {topic}.", "Hi, it's about {topic}.", "Can you help me with {topic}?")
_ACKS = ("OK, noted.", "Thanks for the detail.", "Understood.", "That helps, thank you.")


def _and_list(names: list[str], conj: str) -> str:
    if len(names) == 2:
        return f"{names[0]} {conj} the {names[1]}"
    return ", the ".join(names[:-1]) + f" {conj} the {names[-1]}"


def _clarifying_question(rng: random.Random, names: list[str], verb: str) -> str:
    if len(names) == 2:
        t = rng.choice(_QUESTION_TEMPLATES_2)
        return t.format(a=names[0], b=names[1], verb=verb)
    t = rng.choice(_QUESTION_TEMPLATES_N)
    return t.format(items=_and_list(names, "or"), verb=verb)


_AN = re.compile(r"\b([Aa]) (?=[aeiouAEIOU](?!(?i:ne\b|ne-|se|ni|sb)))")


def _articles(text: str) -> str:
    """'a airport rental car' -> 'an airport rental car' (not before 'one-', 'use', 'uni', 'USB')."""
    return _AN.sub(lambda m: m.group(1) + "n ", text)


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


class _Builder:
    def __init__(self, rng: random.Random, domain: Domain, with_system: bool):
        self.rng = rng
        self.d = domain
        self.turns: list[dict] = []
        self.labelled = 0
        if with_system:
            self.turns.append({"role": "system", "text": domain.system})

    def add(self, role: str, text: str, label: dict | None = None) -> int:
        t: dict = {"role": role, "text": _articles(text)}
        if label is not None:
            t["label"] = label
        self.turns.append(t)
        return len(self.turns) - 1

    def user_intro(self, name: str, quals) -> int:
        """A clear user turn naming ``name``; sometimes labelled as an intermediate 'answer' example."""
        text = self.rng.choice(self.d.problems).format(q=self.rng.choice(quals), e=name)
        if self.rng.random() < 0.5:
            text += " " + _cap(self.rng.choice(self.rng.choice(self.d.actions).explicit).format(e=name))
        return self.add("user", text, self.maybe_label(0.18))

    def maybe_label(self, p: float) -> dict | None:
        """Label a clear intermediate user turn (an extra 'answer' example) with probability ``p``."""
        if self.rng.random() < p and self.labelled < 2:  # at most 2 + the final turn = 3 examples
            self.labelled += 1
            return {"needs_clarification": False}
        return None

    def assistant_tip(self, name: str) -> int:
        return self.add("assistant", self.rng.choice(self.d.tips).format(e=name))

    def filler(self) -> None:
        unused = [x for x in self.d.details if all(x != t["text"] for t in self.turns)] or list(self.d.details)
        self.add("user", self.rng.choice(unused))
        self.add("assistant", self.rng.choice(_ACKS))


def _conversation(rng: random.Random, conv_id: str, seed: int) -> dict:
    d = rng.choice(DOMAINS)
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    multi = kind in CLARIFY_KINDS or kind in ("explicit", "resolved")
    n_cand = 3 if (kind in CLARIFY_KINDS or kind == "explicit") and rng.random() < 0.15 else 2
    picked = rng.sample(list(d.entities), n_cand if multi else 1)
    names = [p[0] for p in picked]
    b = _Builder(rng, d, with_system=rng.random() < 0.2)
    intro: dict[str, int] = {}

    if kind == "ambiguous_profile":
        b.add("user", rng.choice(_OPENERS).format(topic=d.topic))
        if n_cand == 2:
            reply = rng.choice(_PROFILE_REPLIES).format(a=names[0], b=names[1])
        else:
            items = ", ".join(f"a {n}" for n in names[:-1]) + f" and a {names[-1]}"
            reply = rng.choice(_PROFILE_REPLIES_N).format(items=items)
        i = b.add("assistant", reply)
        intro = {n: i for n in names}
        for _ in range(rng.choice((1, 1, 2))):
            b.filler()
    elif multi and rng.random() < 0.35 and n_cand == 2:
        # both named in one user turn
        text = rng.choice(_BOTH_TEMPLATES).format(qa=rng.choice(picked[0][1]), a=names[0], qb=rng.choice(picked[1][1]), b=names[1])
        i = b.add("user", text)
        intro = {n: i for n in names}
        b.add("assistant", rng.choice(_ACKS) + " Which of them would you like help with first?")
        for _ in range(rng.choice((1, 1, 2))):
            b.filler()
    elif multi:
        for k, (name, quals) in enumerate(picked):
            if k == 0:
                intro[name] = b.user_intro(name, quals)
            else:
                text = rng.choice(_SECOND_TEMPLATES).format(q=rng.choice(quals), e=name)
                intro[name] = b.add("user", text, b.maybe_label(0.1))
            b.assistant_tip(name)
        if rng.random() < 0.3:
            b.filler()
    else:  # one entity only: keep the history as long as in the multi-entity kinds
        name, quals = picked[0]
        intro[name] = b.user_intro(name, quals)
        b.assistant_tip(name)
        b.filler()
        if rng.random() < 0.3:
            b.filler()

    if kind == "resolved":
        gone, kept = rng.sample(names, 2)
        b.add("user", rng.choice(_RESOLVE_TEMPLATES).format(a=gone, b=kept))
        b.assistant_tip(kept)

    action = rng.choice(d.actions)
    if kind in ("illformed_multi", "illformed_single"):
        query = rng.choice(action.fragments)
    elif kind == "explicit":
        target = rng.choice(names)
        if rng.random() < 0.4:  # short, ill-formed but naming its referent: "router reset??"
            query = f"{target} {rng.choice(action.fragments)}"
        else:
            query = rng.choice(action.explicit).format(e=target)
    else:
        query = rng.choice(action.pronoun)
    if rng.random() < 0.3:
        query = _cap(query)

    passages: list[dict] = []
    about: dict[str, str] = {}
    if rng.random() < 0.6:
        subjects = list(names)
        rng.shuffle(subjects)
        for k, name in enumerate(subjects[: rng.choice((1, 2))]):
            pid = f"p{k + 1}"
            text = rng.choice(d.passages).replace("{E}", _cap(name)).replace("{e}", name)
            passages.append({"id": pid, "text": _articles(text)})
            about[pid] = name

    if kind in CLARIFY_KINDS:
        cands = list(names)
        rng.shuffle(cands)
        label = {
            "needs_clarification": True,
            "clarifying_question": _clarifying_question(rng, cands, action.verb),
            "grounding_turns": sorted({intro[n] for n in names}),
            "grounding_passages": sorted(pid for pid, n in about.items() if n in names),
        }
    else:
        label = {"needs_clarification": False, "clarifying_question": None, "grounding_turns": [], "grounding_passages": []}
    b.add("user", query, label)
    return {
        "conversation_id": conv_id,
        "domain": d.name,
        "turns": b.turns,
        "passages": passages,
        "meta": {"source": "synthetic", "kind": kind, "seed": seed, "candidates": names},
    }


def generate_conversations(n: int, seed: int = 0) -> list[dict]:
    """``n`` synthetic ConversationLog dicts, deterministic for ``seed``."""
    rng = random.Random(seed)
    return [_conversation(rng, f"syn-{seed}-{i:05d}", seed) for i in range(n)]


def write_logs(out_uri: str, n: int, seed: int = 0, shards: int = 4) -> list[str]:
    """Write ``n`` conversations as JSONL shards under ``out_uri`` (folder or ``s3://`` prefix)."""
    from clarifier.runtime.storage import join, write_text

    convs = generate_conversations(n, seed)
    shards = max(1, min(shards, n)) if n else 1
    uris = []
    for s in range(shards):
        part = convs[s::shards]
        uri = join(out_uri, f"conversations-{s:05d}.jsonl")
        write_text(uri, "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in part))
        uris.append(uri)
    return uris
