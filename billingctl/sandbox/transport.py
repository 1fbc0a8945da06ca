"""httpx transport into the in-process sandbox apps; turns the sandbox's timeout and reset faults
into the transport errors a real network would raise."""

from __future__ import annotations

import httpx


class SandboxTransport(httpx.WSGITransport):
    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.headers["X-Sandbox-In-Process"] = "1"
        try:
            response = super().handle_request(request)
        except Exception:  # a crash inside the simulator is what a remote server's 500 would be
            return httpx.Response(500, json={"message": "sandbox error", "type": "api_error",
                                             "api_error_code": "internal_error"}, request=request)
        fault = response.headers.get("X-Sandbox-Fault")
        if fault == "timeout":
            raise httpx.ReadTimeout("sandbox: simulated timeout", request=request)
        if fault == "reset":
            raise httpx.RemoteProtocolError("sandbox: simulated connection reset", request=request)
        return response
