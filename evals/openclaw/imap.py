"""A real IMAP server for the assistant scenario: Dovecot's `imap` from Debian's packages, on loopback.

Contract: `dovecot_imap(clients_dir)` is the path of Dovecot's `imap` binary as
`evals/openclaw/install_imap.sh` unpacks it (`apt-get download` + `dpkg -x`, no root needed) under
`<clients_dir>/dovecot/`, or None when it is not there. `ImapServer(imap, maildir)` is a context
manager that listens on a free loopback port (`port`) and serves each connection inetd-style: one
pre-authenticated Dovecot `imap` process per connection, the socket as its stdin and stdout, its
settings from the environment (`DOVECONF_ENV`: no config file, no master process), the mailbox the
Maildir `maildir`. Dovecot refuses mail access as root, so when this process is root each `imap`
runs as `nobody` (`setpriv`) and the Maildir is made writable for it. Stops on exit.
"""

from __future__ import annotations

import os
import socket
import socketserver
import subprocess
import threading
from pathlib import Path

NOBODY = 65534
IMAP_REL = "dovecot/root/usr/lib/dovecot/imap"


def dovecot_imap(clients_dir: Path) -> Path | None:
    path = clients_dir / IMAP_REL
    return path if path.exists() else None


class ImapServer:
    def __init__(self, imap: Path, maildir: Path) -> None:
        self.imap, self.maildir = imap, maildir
        self.port = 0

    def command(self) -> tuple[list[str], dict[str, str]]:
        env = {"DOVECONF_ENV": "1", "MAIL": f"maildir:{self.maildir}", "HOME": str(self.maildir),
               "USER": "me", "LD_LIBRARY_PATH": str(self.imap.parent), "PATH": "/usr/bin:/bin"}
        cmd = [str(self.imap)]
        if os.geteuid() == 0:
            cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd]
        return cmd, env

    def __enter__(self) -> ImapServer:
        for sub in ("cur", "new", "tmp"):
            (self.maildir / sub).mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            for p in [self.maildir, *self.maildir.rglob("*")]:
                os.chown(p, NOBODY, NOBODY)
            for p in self.maildir.parents:  # nobody must reach the Maildir
                mode = p.stat().st_mode
                if not mode & 0o001:
                    p.chmod(mode | 0o001)
        cmd, env = self.command()

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock: socket.socket = self.request
                proc = subprocess.Popen(cmd, stdin=sock.fileno(), stdout=sock.fileno(), stderr=subprocess.DEVNULL,
                                        env=env)
                proc.wait()

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
