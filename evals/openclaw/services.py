"""Local services of the assistant scenario, on loopback: CalDAV (Radicale) and SMTP (aiosmtpd).

Contract: `Services(root, imap)` is a context manager: it seeds the inbox, a Maildir
(`root/inbox/{cur,new,tmp}`, three messages) served over IMAP on loopback by Dovecot's `imap`
(imap.py) when `imap` (its binary) is given, else read as files by the workspace's `mail.py`
(`inbox` says which: "imap" or "folder"); starts
an SMTP sink (aiosmtpd on a free port; every message it receives is kept in `sent`, parsed) and
Radicale (a subprocess, no password check, user `user` owning its collections, storage under `root/caldav`), and creates the calendar
collection `calendar_url`. `events()` maps each event's UID to its iCalendar text, read back from
the CalDAV server over HTTP. `env` holds the addresses the workspace helpers use. Everything stops
on exit. Needs `radicale` and `aiosmtpd` (the test extra).
"""

from __future__ import annotations

import email
import re
import socket
import subprocess
import sys
import time
from email.message import Message
from pathlib import Path
from typing import Any

import httpx

AUTH = ("user", "eval")  # Radicale without authentication checks no password; `owner_only` needs a user
INBOX = [
    ("alice@example.com", "Project review", "Hi, the project review is on 2027-01-12 from 10:00 to 11:00. "
                                            "Can you make it?\nAlice"),
    ("bob@example.com", "Our 1:1", "Hi, can we meet on 2027-01-13 at 14:00 for 30 minutes? If 15:00 "
                                   "works better for you, take that instead.\nBob"),
    ("news@example.com", "Weekly newsletter", "This week: the cafeteria reopens on Monday, the parking lot "
                                              "is closed on Friday, and the all-hands moves to Thursday."),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Services:
    def __init__(self, root: Path, imap: Path | None = None) -> None:
        self.root, self.imap = root, imap
        self.inbox = "imap" if imap else "folder"
        self.sent: list[Message] = []
        self.smtp_port = _free_port()
        self.caldav_port = _free_port()
        self.calendar_url = f"http://127.0.0.1:{self.caldav_port}/user/calendar/"
        self.env = {"EVAL_SMTP": f"127.0.0.1:{self.smtp_port}", "EVAL_CALDAV": self.calendar_url,
                    "EVAL_INBOX": str(root / "inbox")}

    def __enter__(self) -> Services:
        from aiosmtpd.controller import Controller

        inbox = self.root / "inbox"
        for sub in ("cur", "new", "tmp"):
            (inbox / sub).mkdir(parents=True, exist_ok=True)
        for i, (sender, subject, body) in enumerate(INBOX, 1):
            (inbox / "cur" / f"{1800000000 + i}.{i}.eval:2,").write_text(
                f"From: {sender}\nTo: me@example.com\nSubject: {subject}\n\n{body}\n")
        self.imap_server = None
        if self.imap is not None:
            from evals.openclaw.imap import ImapServer

            self.imap_server = ImapServer(self.imap, inbox).__enter__()
            self.env["EVAL_IMAP"] = f"127.0.0.1:{self.imap_server.port}"
        sink = self

        class Handler:
            async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
                sink.sent.append(email.message_from_bytes(envelope.original_content or envelope.content))
                return "250 OK"

        self.smtp = Controller(Handler(), hostname="127.0.0.1", port=self.smtp_port)
        self.smtp.start()
        self.radicale = subprocess.Popen(
            [sys.executable, "-m", "radicale", "--server-hosts", f"127.0.0.1:{self.caldav_port}",
             "--storage-filesystem-folder", str(self.root / "caldav"), "--auth-type", "none", "--rights-type", "owner_only",
             "--logging-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.request("MKCALENDAR", self.calendar_url, auth=AUTH, timeout=5)
                if r.status_code in (201, 405):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.radicale.poll() is not None:
                self.__exit__()
                raise RuntimeError("Radicale did not start")
            time.sleep(0.3)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.imap_server is not None:
            self.imap_server.__exit__()
        self.smtp.stop()
        self.radicale.terminate()
        try:
            self.radicale.wait(10)
        except subprocess.TimeoutExpired:
            self.radicale.kill()

    def events(self) -> dict[str, str]:
        body = ('<?xml version="1.0"?><d:propfind xmlns:d="DAV:"><d:prop><d:getetag/></d:prop></d:propfind>')
        r = httpx.request("PROPFIND", self.calendar_url, headers={"Depth": "1"}, content=body, auth=AUTH, timeout=10)
        out = {}
        for href in re.findall(r"<[^>]*href>([^<]+\.ics)</", r.text):
            ics = httpx.get(f"http://127.0.0.1:{self.caldav_port}{href}", auth=AUTH, timeout=10).text
            uid = re.search(r"^UID:(.+?)\r?$", ics, re.M)
            if uid:
                out[uid.group(1).strip()] = ics
        return out
