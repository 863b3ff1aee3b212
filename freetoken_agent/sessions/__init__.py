"""The session manager: client profiles, request normalisation, anchor planning, divergence
learning and per-session cache inspection. `ChatService` passes every request through
`SessionManager`; the HTTP layer reads `sessions()` / `session(id)`."""

from freetoken_agent.sessions.anchors import AnchorPlanner, AnchorPolicy
from freetoken_agent.sessions.manager import RequestPlan, SessionManager
from freetoken_agent.sessions.profiles import BY_NAME, Detection, detect

__all__ = ["BY_NAME", "AnchorPlanner", "AnchorPolicy", "Detection", "RequestPlan", "SessionManager", "detect"]
