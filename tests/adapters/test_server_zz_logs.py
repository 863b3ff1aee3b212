"""Runs last: after the whole session, every server is still up and its log shows no exception that
escaped request handling (an engine thread that died, an event-loop callback that raised)."""

from __future__ import annotations

import re

from server_fixture import ServerProcess

ESCAPED = re.compile(r"^(Exception in thread .*|Exception in callback .*)$", re.MULTILINE)


def test_servers_alive_and_logs_clean(servers: dict[str, ServerProcess]) -> None:
    problems = []
    for name, server in servers.items():
        assert server.alive(), f"server {name} died:\n{server.log()[-3000:]}"
        log = server.log()
        for m in ESCAPED.finditer(log):
            tail = log[m.start():m.start() + 1500]
            problems.append(f"[{name}] {tail}")
    assert not problems, "\n\n".join(problems)
