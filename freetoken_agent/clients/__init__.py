"""Small, dependency-free helpers for writing coding-agent client configuration files.

`json5.loads` reads JSON5/JSONC (OpenClaw's and OpenCode's config syntax); `toml_writer.dumps`
writes the TOML that `tomllib` reads (Codex's `config.toml`). `freetoken_agent.configure` uses both.
"""
