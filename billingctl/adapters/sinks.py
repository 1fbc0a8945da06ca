"""Outbound sinks: chat alerts (Slack-compatible incoming webhook), user notifications, analytics.

Each is a small HTTP POST of JSON; failures raise so the outbox keeps the message and retries."""

from __future__ import annotations

import httpx

from billingctl.adapters import tls
from billingctl.domain.errors import ExternalUnavailable

SINK_SETTINGS = {"chat": "alert_webhook_url", "notify": "notify_url", "analytics": "analytics_url"}


class HttpSink:
    def __init__(self, name: str, url: str | None, timeout: float = 5.0):
        self.name = name
        self.url = url
        self.timeout = timeout

    @property
    def configured(self) -> bool:
        return bool(self.url)

    def send(self, payload: dict, dedupe_key: str) -> None:
        try:
            response = httpx.post(self.url, json=payload, timeout=self.timeout,
                                  headers={"Idempotency-Key": dedupe_key}, verify=tls.context())
        except httpx.HTTPError as exc:
            raise ExternalUnavailable(f"{self.name} sink: {type(exc).__name__}") from exc
        if response.status_code >= 300:
            raise ExternalUnavailable(f"{self.name} sink answered HTTP {response.status_code}")


def slack_escape(value) -> str:
    """Slack's three control characters: data never becomes a mention (<!channel>), a link or markup."""
    return str(value).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def chat_message(text: str, **fields) -> dict:
    """Slack-compatible incoming-webhook JSON. Every piece of data is escaped; attachments carry a
    plain-text `fallback` for clients (and notifications) that do not render fields."""
    payload = {"text": slack_escape(text)}
    if fields:
        rows = [{"title": k, "value": slack_escape(v), "short": True} for k, v in fields.items()]
        fallback = slack_escape(text) + " (" + ", ".join(f"{r['title']}: {r['value']}" for r in rows) + ")"
        payload["attachments"] = [{"fallback": fallback, "fields": rows}]
    return payload
