"""How the sandbox hands its signed webhooks to us, as the real systems would: over HTTP to
BILLING_SANDBOX_WEBHOOK_URL, or, without a URL, straight into an in-process WSGI receiver. The receiver
is provided by whoever composes the running program (the web app registers itself; the CLI and the tests
provide it), so the container never imports the web layer."""

from __future__ import annotations

from collections.abc import Callable

from billingctl.domain.errors import ConfigError

_receiver_loaders: list[Callable[[], Callable]] = []


def provide_receiver(loader: Callable[[], Callable]) -> None:
    """`loader()` returns the factory of the in-process receiver: `factory(container=…)` -> a WSGI app.
    The first one provided is used."""
    if not _receiver_loaders:
        _receiver_loaders.append(loader)


class WebhookDelivery:
    def __init__(self, container):
        self.container = container
        self._client = None

    def __call__(self, path: str, body: bytes, headers: dict) -> int:
        import httpx

        url = self.container.settings.sandbox_webhook_url
        if url:
            return httpx.post(url.rstrip("/") + path, content=body, headers=headers, timeout=10).status_code
        if self._client is None:
            if not _receiver_loaders:
                raise ConfigError("the sandbox has nowhere to deliver its webhooks: set BILLING_SANDBOX_WEBHOOK_URL")
            app = _receiver_loaders[0]()(container=self.container)
            self._client = httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://billing.local")
        return self._client.post(path, content=body, headers=headers).status_code

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
