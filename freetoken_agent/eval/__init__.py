"""`freetoken-agent eval`: agent workloads a user runs against a server (ours or any OpenAI /
Anthropic-compatible one): `replay` of recorded request traces, `swe` (small SWE-bench-shaped
tasks driven through a real agent client), `openclaw` (an email / calendar assistant).

Every eval writes the same report (`report.py`): per turn prompt / reused / recomputed tokens,
TTFT, decode tok/s, the divergence cause; per run the aggregates; JSON, Markdown and a PNG plot.
Nothing here is imported by `freetoken-agent --help`: `cli.py` loads the rest inside `run_eval`.
"""
