"""`freetoken-agent eval swe`: SWE-bench-shaped tasks solved through a real agent client."""
