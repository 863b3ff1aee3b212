"""Each coding-agent client's configuration: where it lives (`claude_code`, `opencode`, `openclaw`,
`codex`), the server it points at (`target`), and reading, merging and rewriting its file (`files`,
through the `json5` and `tomlkit` libraries). `freetoken_agent.configure` is the public API.
"""
