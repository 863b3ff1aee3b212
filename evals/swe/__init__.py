"""The built-in tasks of `freetoken-agent eval swe`: `tasks/<id>/repo/` is a tiny Python repository
with one real bug, `tasks/<id>/task.json` its issue text, fail-to-pass / pass-to-pass test ids and
the reference fix (exact replacements; the unified-diff patch is derived from them)."""
