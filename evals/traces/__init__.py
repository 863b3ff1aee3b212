"""Agent traces: scripted capture from real CLIs, sanitised storage, and replay against a server."""
