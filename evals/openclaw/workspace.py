"""The assistant's workspace helpers, written into its work dir: `mail.py` (list / read the inbox
over IMAP, or as the Maildir's files where the eval runs no IMAP server; send through SMTP) and `cal.py` (add / list / move / delete events on the CalDAV calendar). They
read the services' addresses from `eval.json` next to them and use only Python's standard library,
so any client reaches them through its shell tool; and the assistant's standing context
(context.py: `AGENTS.md`, `SOUL.md`, `IDENTITY.md`), which OpenClaw injects into its system prompt."""

from __future__ import annotations

import json
from pathlib import Path

from evals.openclaw.context import bootstrap_files

MAIL = r'''"""Mail: python3 mail.py list | read N | send TO SUBJECT BODY"""
import email, imaplib, json, pathlib, smtplib, sys
from email.message import EmailMessage
cfg = json.loads((pathlib.Path(__file__).parent / "eval.json").read_text())
def inbox():
    if "EVAL_IMAP" in cfg:  # the IMAP server's INBOX, in sequence order
        host, port = cfg["EVAL_IMAP"].split(":")
        with imaplib.IMAP4(host, int(port)) as m:  # pre-authenticated
            n = int(m.select("INBOX", readonly=True)[1][0])
            return [m.fetch(str(i), "(BODY.PEEK[])")[1][0][1].decode() for i in range(1, n + 1)]
    return [p.read_text() for p in sorted(pathlib.Path(cfg["EVAL_INBOX"], "cur").iterdir())]
cmd = sys.argv[1]
if cmd == "list":
    for i, text in enumerate(inbox(), 1):
        m = email.message_from_string(text)
        print(f"{i}. {m['From']}: {m['Subject']}")
elif cmd == "read":
    print(inbox()[int(sys.argv[2]) - 1].replace("\r\n", "\n"))
elif cmd == "send":
    m = EmailMessage()
    m["From"], m["To"], m["Subject"] = "me@example.com", sys.argv[2], sys.argv[3]
    m.set_content(sys.argv[4])
    host, port = cfg["EVAL_SMTP"].split(":")
    with smtplib.SMTP(host, int(port)) as s:
        s.send_message(m)
    print("sent to", sys.argv[2])
'''

CAL = r'''"""Calendar: python3 cal.py list | add UID SUMMARY START END | move UID START END | delete UID
(times as 20270112T100000)"""
import json, pathlib, re, sys, urllib.request
cfg = json.loads((pathlib.Path(__file__).parent / "eval.json").read_text())
url = cfg["EVAL_CALDAV"]
def call(method, path="", data=None, headers=None):
    auth = {"Authorization": "Basic dXNlcjpldmFs"}  # user:eval
    req = urllib.request.Request(url + path, data=data, method=method, headers={**auth, **(headers or {})})
    with urllib.request.urlopen(req) as r:
        return r.read().decode()
def ics(uid, summary, start, end):
    return ("BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:-//eval//EN\r\nBEGIN:VEVENT\r\n"
            f"UID:{uid}\r\nDTSTAMP:20270101T000000Z\r\nDTSTART:{start}\r\nDTEND:{end}\r\n"
            f"SUMMARY:{summary}\r\nEND:VEVENT\r\nEND:VCALENDAR\r\n").encode()
def events():
    xml = call("PROPFIND", headers={"Depth": "1"})
    for href in re.findall(r"<[^>]*href>([^<]+\.ics)</", xml):
        text = call("GET", href.rsplit("/", 1)[1])
        yield {k: v.strip() for k, v in re.findall(r"^(UID|SUMMARY|DTSTART|DTEND):(.*)$", text, re.M)}
cmd = sys.argv[1]
put = {"Content-Type": "text/calendar"}
if cmd == "list":
    for e in sorted(events(), key=lambda e: e["DTSTART"]):
        print(f"{e['DTSTART']}-{e['DTEND']} {e['SUMMARY']} ({e['UID']})")
elif cmd == "add":
    call("PUT", f"{sys.argv[2]}.ics", ics(*sys.argv[2:6]), put)
    print("added", sys.argv[2])
elif cmd == "move":
    e = next(e for e in events() if e["UID"] == sys.argv[2])
    call("PUT", f"{sys.argv[2]}.ics", ics(sys.argv[2], e["SUMMARY"], sys.argv[3], sys.argv[4]), put)
    print("moved", sys.argv[2])
elif cmd == "delete":
    call("DELETE", f"{sys.argv[2]}.ics")
    print("deleted", sys.argv[2])
'''


def write_workspace(work: Path, env: dict[str, str]) -> None:
    work.mkdir(parents=True, exist_ok=True)
    for name, text in bootstrap_files().items():
        (work / name).write_text(text)
    (work / "mail.py").write_text(MAIL)
    (work / "cal.py").write_text(CAL)
    (work / "eval.json").write_text(json.dumps(env))
    (work / "README.md").write_text("# Assistant workspace\n\n`python3 mail.py list|read N|send TO SUBJECT BODY`\n"
                                    "`python3 cal.py list|add UID SUMMARY START END|move UID START END|delete UID`\n")
