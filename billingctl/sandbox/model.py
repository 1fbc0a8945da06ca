"""The sandbox's behaviour: one subscription provider and one payment orchestrator sharing one store.

Like the deployment the spec describes, the orchestrator's lane workflow reports each settled
payment to the provider (the invoice is paid with the payment id as reference and the provider
emits payment_succeeded), and signed webhooks are delivered to the billing service. Each vendor is a
module of its own (`provider`, `orchestrator`); these names are the sandbox's interface."""

from billingctl.sandbox.base import CATALOG, FOREIGN_CATALOG, SandboxError
from billingctl.sandbox.orchestrator import IN_FLIGHT, WEBHOOK_RETRIES, OrchestratorModel, sign_body
from billingctl.sandbox.provider import PAYABLE_INVOICE_STATUSES, ProviderModel

__all__ = ["CATALOG", "FOREIGN_CATALOG", "IN_FLIGHT", "PAYABLE_INVOICE_STATUSES", "WEBHOOK_RETRIES", "Sandbox",
           "SandboxError", "sign_body"]


class Sandbox(ProviderModel, OrchestratorModel):
    """The provider and the orchestrator on one store, as the billing service sees them over HTTP."""
