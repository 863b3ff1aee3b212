"""The 13 user turns of the assistant scenario (W4), each with its scripted steps and the state the
services must be in after it.

Contract: `TURNS` is a list of `Turn(prompt, steps, events, sent)`: `steps` are the scripted
replies' steps (`("run", shell command)` through the client's shell tool, using the workspace's
`mail.py` / `cal.py`, then `("answer", text)`), `events` the calendar after the turn ({UID:
DTSTART}) and `sent` every mail the SMTP sink holds after it ([(to, subject)]). Read-only turns
leave both as the turn before.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass


def _mail(*args: str) -> tuple[str, str]:
    return ("run", "python3 mail.py " + " ".join(shlex.quote(a) for a in args))


def _cal(*args: str) -> tuple[str, str]:
    return ("run", "python3 cal.py " + " ".join(shlex.quote(a) for a in args))


@dataclass(frozen=True)
class Turn:
    prompt: str
    steps: tuple[tuple[str, ...], ...]
    events: dict[str, str]
    sent: tuple[tuple[str, str], ...]


REVIEW = {"review": "20270112T100000"}
ONE_ON_ONE = {"one-on-one": "20270113T150000"}
R1 = (("alice@example.com", "Re: Project review"),)
R2 = (*R1, ("bob@example.com", "Re: Our 1:1"))
R3 = (*R2, ("alice@example.com", "Project review cancelled"))

TURNS = [
    Turn("What is in my inbox?", (_mail("list"), ("answer", "Three messages: Alice (project review), Bob (1:1), "
                                                             "and the weekly newsletter.")), {}, ()),
    Turn("Read Alice's message about the project review.",
         (_mail("read", "1"), ("answer", "Alice invites you to the project review on 2027-01-12, 10:00-11:00.")), {}, ()),
    Turn("Put the project review on my calendar as Alice wrote.",
         (_cal("add", "review", "Project review", "20270112T100000", "20270112T110000"),
          ("answer", "Added: Project review, 2027-01-12 10:00-11:00.")), REVIEW, ()),
    Turn("Reply to Alice that I will be there.",
         (_mail("send", "alice@example.com", "Re: Project review", "I will be there."),
          ("answer", "Replied to Alice.")), REVIEW, R1),
    Turn("Now read Bob's message.", (_mail("read", "2"), ("answer", "Bob proposes a 1:1 on 2027-01-13 at 14:00 "
                                                                      "for 30 minutes, or 15:00.")), REVIEW, R1),
    Turn("Add the 1:1 with Bob at the first time he proposed.",
         (_cal("add", "one-on-one", "1:1 with Bob", "20270113T140000", "20270113T143000"),
          ("answer", "Added the 1:1 on 2027-01-13 at 14:00.")), {**REVIEW, "one-on-one": "20270113T140000"}, R1),
    Turn("Actually 15:00 suits me better: move the 1:1.",
         (_cal("move", "one-on-one", "20270113T150000", "20270113T153000"), ("answer", "Moved the 1:1 to 15:00.")),
         {**REVIEW, **ONE_ON_ONE}, R1),
    Turn("Let Bob know the 1:1 is at 15:00.",
         (_mail("send", "bob@example.com", "Re: Our 1:1", "15:00 works better for me, see you then."),
          ("answer", "Told Bob.")), {**REVIEW, **ONE_ON_ONE}, R2),
    Turn("Summarise the newsletter for me.",
         (_mail("read", "3"), ("answer", "The cafeteria reopens Monday, parking is closed Friday, the all-hands "
                                         "moves to Thursday.")), {**REVIEW, **ONE_ON_ONE}, R2),
    Turn("What is on my calendar?", (_cal("list"), ("answer", "The project review on the 12th and the 1:1 on "
                                                               "the 13th at 15:00.")), {**REVIEW, **ONE_ON_ONE}, R2),
    Turn("The project review was cancelled: remove it from my calendar.",
         (_cal("delete", "review"), ("answer", "Removed the project review.")), ONE_ON_ONE, R2),
    Turn("Tell Alice that the review is cancelled.",
         (_mail("send", "alice@example.com", "Project review cancelled", "The review is cancelled; I removed it."),
          ("answer", "Told Alice.")), ONE_ON_ONE, R3),
    Turn("List my calendar once more and confirm that only the 1:1 is left.",
         (_cal("list"), ("answer", "Only the 1:1 with Bob on 2027-01-13 at 15:00 is left.")), ONE_ON_ONE, R3),
]
