"""The W4 scenario of `freetoken-agent eval openclaw`: local mail and CalDAV services, the
assistant's workspace helpers, and the 13 user turns with their checks."""
