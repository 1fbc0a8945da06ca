"""What the sandbox's two vendors share: one store, the catalog it is seeded with, and the provider's
error shape, in which both refuse (the orchestrator app nests it as its API does)."""

from __future__ import annotations

from collections.abc import Callable

from billingctl.sandbox.store import SandboxStore

CATALOG = [
    {"id": "credits-basic-USD-monthly", "item_id": "credits-basic", "name": "Basic monthly", "price": 999,
     "metadata": {"credits": 1000, "lane": "sfw"}},
    {"id": "credits-pro-USD-monthly", "item_id": "credits-pro", "name": "Pro monthly", "price": 1999,
     "metadata": {"credits": 2000, "lane": "sfw"}},
    {"id": "credits-pro-nsfw-USD-monthly", "item_id": "credits-pro-nsfw", "name": "Pro (NSFW) monthly",
     "price": 2999, "metadata": {"credits": 3000, "lane": "nsfw"}},
    {"id": "credits-max-nsfw-USD-monthly", "item_id": "credits-max-nsfw", "name": "Max (NSFW) monthly",
     "price": 4999, "metadata": {"credits": 6000, "lane": "nsfw"}},
]
# A real catalog also holds addon and charge item prices (and plans of other products) without our
# metadata: product listing must skip them, never fail on them.
FOREIGN_CATALOG = [
    {"id": "extra-storage-USD-monthly", "item_id": "extra-storage", "name": "Extra storage", "price": 299,
     "item_type": "addon"},
    {"id": "setup-fee-USD", "item_id": "setup-fee", "name": "Setup fee", "price": 500, "item_type": "charge",
     "period": None, "period_unit": None},
    {"id": "legacy-team-USD-monthly", "item_id": "legacy-team", "name": "Legacy team plan", "price": 9900,
     "item_type": "plan"},
]
# Subscription statuses the provider accepts change_term_end for (the rest: invalid_state_for_request).


class SandboxError(Exception):
    """A refusal, in the provider's error shape; the orchestrator app nests it as its API does."""

    def __init__(self, status: int, message: str, api_error_code: str = "invalid_request", param: str | None = None,
                 error_type: str = "invalid_request"):
        super().__init__(message)
        self.status = status
        self.api_error_code = api_error_code
        self.body = {"message": message, "type": error_type, "api_error_code": api_error_code,
                     "http_status_code": status}
        if param:
            self.body["param"] = param


class SandboxBase:
    """The store and the secrets both vendors' models work on; `Sandbox` is the two of them together."""

    def __init__(self, store: SandboxStore, webhook_secret: str = "",
                 deliver: Callable[[str, bytes, dict], int] | None = None, disputes_secret: str = ""):
        self.store = store
        self.webhook_secret = webhook_secret
        self.disputes_secret = disputes_secret
        self.deliver = deliver
        if not self.store.meta("seeded"):
            self.seed()

    def seed(self) -> None:
        now = int(self.store.now())
        for price in CATALOG + FOREIGN_CATALOG:
            self.store.put("item_price", price["id"], {
                "status": "active", "pricing_model": "flat_fee", "currency_code": "USD", "period": 1,
                "period_unit": "month", "item_type": "plan", "updated_at": now, "object": "item_price", **price})
        self.store.set_meta("seeded", True)

    def now(self) -> int:
        return int(self.store.now())

