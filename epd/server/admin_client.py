"""A launcher's calls to the router's admin API (register, drain, the planner's plan), with the
admin token: one home for ``epd serve``'s scaler and the Ray deployment's registrar."""
from __future__ import annotations

import json
import urllib.request


def admin_request(admin_url: str, token: str, method: str, path: str = "/admin/workers",
                  body: dict | None = None, timeout_s: float = 120.0) -> dict:
    """The JSON answer; an HTTP error raises ``urllib.error.HTTPError`` (an ``OSError``, as an
    unreachable router's is)."""
    request = urllib.request.Request(f"{admin_url}{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        return json.loads(reply.read())
