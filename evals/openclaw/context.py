"""The assistant's standing context: the workspace files OpenClaw injects into its system prompt.

Contract: `bootstrap_files()` maps the bootstrap files OpenClaw 2026.9.6 always injects
(`AGENTS.md`, `SOUL.md`, `IDENTITY.md`) to their text: in `AGENTS.md` the assistant's operating
rules, the workspace tools (`mail.py`, `cal.py`), the user's profile and contacts and a long memory
of earlier, unrelated correspondence; the persona and the identity in the other two. Deterministic (a fixed seed), about `MEMORY_CHARS` +
20k characters in all: with OpenClaw 2026.9.6's own system prompt and tool schemas (about 8k
tokens) the system context is about 24k tokens, the paper's W4 setting. `BOOTSTRAP_LIMITS` are the
OpenClaw settings (`agents.defaults`) that let all of it in (its defaults cap a file at 20000 and
the whole at 60000 characters).
"""

from __future__ import annotations

import random

MEMORY_CHARS = 44_000
BOOTSTRAP_LIMITS = {"bootstrapMaxChars": 60_000, "bootstrapTotalMaxChars": 120_000}

_FIRST = ["Alice", "Bob", "Carla", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kemal", "Lena",
          "Marco", "Nadia", "Oskar", "Priya", "Quentin", "Rosa", "Sven", "Tara", "Umar", "Vera", "Wim", "Yara"]
_LAST = ["Novak", "Okafor", "Lindqvist", "Moreau", "Tanaka", "Schulz", "Costa", "Haddad", "Kowalski", "Nguyen",
         "Ferreira", "Jensen", "Rossi", "Petrov", "Alvarez", "Brennan"]
_TEAMS = ["platform", "billing", "design", "research", "support", "finance", "legal", "hiring", "security", "sales"]
_TOPICS = ["the quarterly budget", "the office move", "the vendor contract", "a conference talk", "the hiring plan",
           "the release checklist", "an expense report", "the team offsite", "a customer escalation",
           "the security audit", "the onboarding guide", "a travel booking", "the roadmap review",
           "the data retention policy", "a laptop replacement", "the on-call rota"]
_OUTCOMES = ["agreed to follow up next week", "asked for the slides in advance", "moved it to the following Monday",
             "declined politely and suggested a colleague", "confirmed by mail the same day",
             "wanted a shorter meeting", "sent the signed copy back", "asked to keep the finance team in copy",
             "preferred a video call", "will decide after the board meeting"]

AGENTS = """# AGENTS.md: how this assistant works

You manage one person's mailbox and calendar. Work only through the workspace tools described
below, run from the workspace directory with the shell tool. Never invent mail or events.

## Mail
- Read a message before answering it. Quote dates and times exactly as the sender wrote them.
- Replies keep the subject with a `Re: ` prefix. Write short, friendly, plain-text replies.
- Never send mail to anyone the user did not name or who did not write to the user.
- After sending, say in one sentence to whom and about what.

## Calendar
- Event UIDs are short lowercase words (`review`, `bob-1on1`); times are local, as YYYYMMDDTHHMMSS.
- Before adding an event, list the calendar and check for conflicts; mention any you find.
- Moving an event keeps its UID and summary; deleting needs an explicit request.
- Default meeting length: 30 minutes for 1:1s, 60 minutes for reviews.

## Style
- Answer in at most three sentences unless asked for a summary.
- When something is ambiguous, choose the option the sender offered first and say so.
"""

SOUL = """# SOUL.md

Calm, precise and brief. You treat the user's time as scarce: no filler, no exclamation marks, no
apologies for things that went right. You are discreet about other people's mail.
"""

IDENTITY = """# IDENTITY.md

Name: Pim. Role: personal mail and calendar assistant. Works for the user described in AGENTS.md.
"""

TOOLS = """## The workspace tools

- `python3 mail.py list`: the inbox, one numbered line per message (`N. sender: subject`).
- `python3 mail.py read N`: message N in full (headers, blank line, body).
- `python3 mail.py send TO SUBJECT BODY`: sends one plain-text message over SMTP.
- `python3 cal.py list`: every event as `START-END SUMMARY (UID)`, oldest first.
- `python3 cal.py add UID SUMMARY START END`: creates an event.
- `python3 cal.py move UID START END`: changes an event's time.
- `python3 cal.py delete UID`: removes an event.

The tools read their server addresses from `eval.json`; do not edit it. Quote arguments with spaces.
"""


def _contacts(rng: random.Random) -> str:
    lines = ["## The user", "", "The user: Sam Reiter, engineering manager, time zone Europe/Berlin, works 09:00-17:30,",
             "no meetings before 10:00 on Mondays, prefers mornings for reviews.", "", "## Contacts", ""]
    for first in _FIRST:
        last = rng.choice(_LAST)
        team = rng.choice(_TEAMS)
        lines.append(f"- {first} {last} <{first.lower()}@example.com>: {team} team; "
                     f"prefers {rng.choice(['mail', 'short calls', 'afternoons', 'mornings'])}; "
                     f"last met about {rng.choice(_TOPICS)}.")
    return "\n".join(lines) + "\n"


def _memory(rng: random.Random, chars: int) -> str:
    lines = ["## Memory: earlier correspondence (oldest first)", ""]
    size, day = sum(len(s) + 1 for s in lines), 0
    while size < chars:
        day += rng.randint(1, 3)
        month, dom = 1 + (day // 28) % 12, 1 + day % 28
        who = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
        line = (f"- 2026-{month:02d}-{dom:02d}: {who} ({rng.choice(_TEAMS)}) wrote about {rng.choice(_TOPICS)}; "
                f"the user {rng.choice(_OUTCOMES)}. Meeting at {rng.randint(9, 16):02d}:{rng.choice(['00', '30'])}"
                f" for {rng.choice([15, 30, 45, 60])} minutes, reference #{rng.randint(1000, 9999)}.")
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines) + "\n"


def bootstrap_files() -> dict[str, str]:
    rng = random.Random(24)
    agents = "\n".join([AGENTS, TOOLS, _contacts(rng), _memory(rng, MEMORY_CHARS)])
    return {"AGENTS.md": agents, "SOUL.md": SOUL, "IDENTITY.md": IDENTITY}
