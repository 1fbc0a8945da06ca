"""`billingctl sandbox`: drive the local simulators of the provider and the orchestrator."""

from __future__ import annotations

from typing import Literal

import typer

from billingctl.cli.context import command, get_ctx, noun

app = noun("The local sandbox of the subscription provider and the payment orchestrator.")

FAULT_KINDS = ("429", "500", "503", "401", "timeout", "reset", "malformed", "slow", "slow_answer",
               "error_after_effect")


def _sandbox(changes: bool = True):
    """(the CLI context, the sandbox). A command that `changes` the sandbox refuses `--dry-run` (exit 2,
    nothing done) rather than do it for real (issue 38): a sandbox verb has nothing to preview."""
    from billingctl.domain.errors import InvalidInput, Refused

    cli = get_ctx()
    settings = cli.container.settings
    if settings.is_production:
        raise Refused("the sandbox is not available with BILLING_ENV=production")
    if changes and cli.dry_run:
        raise InvalidInput("--dry-run is not supported here: this sandbox command changes the sandbox")
    return cli, cli.container.sandbox


def _call(fn, *args, **kwargs):
    """Sandbox refusals are the operator's input problem: not found (3) or refused (3)."""
    from billingctl.domain.errors import NotFound, Refused
    from billingctl.sandbox.model import SandboxError

    try:
        return fn(*args, **kwargs)
    except SandboxError as exc:
        raise (NotFound if exc.status == 404 else Refused)(str(exc)) from None


@command(app, "serve")
def serve(port: int = typer.Option(8900, "--port"), host: str = typer.Option("127.0.0.1", "--host")):
    """Serve both simulators on loopback: /provider/api/v2/… and /orchestrator/…"""
    from werkzeug.serving import run_simple

    from billingctl import startup
    from billingctl.sandbox.apps import create_combined_app, handler_dated_by_the_app

    cli, sandbox = _sandbox()
    startup.end()  # a server: its start-up is over before it serves
    cli.output.info(f"BILLING_PROVIDER_URL=http://{host}:{port}/provider "
                    f"BILLING_ORCHESTRATOR_URL=http://{host}:{port}/orchestrator")
    run_simple(host, port, create_combined_app(sandbox), threaded=True, use_reloader=False,
               request_handler=handler_dated_by_the_app())




@command(app, "catalog")
def catalog():
    """The sandbox's item prices (item_price_id, type, lane, amount, currency, credits); addons, charges and plans
    of other products carry no lane or credits, as in a real catalog."""
    cli, sandbox = _sandbox(changes=False)
    # Named as `products list` names them: one vocabulary for one thing.
    rows = [{"item_price_id": p["id"], "item_type": p["item_type"], "lane": (p.get("metadata") or {}).get("lane"),
             "amount": p["price"], "currency": p["currency_code"], "credits": (p.get("metadata") or {}).get("credits")}
            for p in sandbox.store.all("item_price")]
    cli.output.table(rows, title="sandbox catalog")


@command(app, "pay")
def pay(order_id: str = typer.Argument(..., help="The checkout's order id (the invoice id)."),
        processor: str = typer.Option(None, "--processor", help="Settle on this processor."),
        drop_webhook: bool = typer.Option(False, "--drop-webhook", help="Do not deliver the payments webhook."),
        duplicates: int = typer.Option(1, "--duplicates", min=1, help="Deliver the webhook N times."),
        wallet: bool = typer.Option(False, "--wallet", help="Pay with a wallet instead of a card."),
        no_provider_report: bool = typer.Option(False, "--no-provider-report",
                                                help="The workflow does not report to the provider.")):
    """Settle a checkout in the sandbox orchestrator and deliver (or drop) its webhook."""
    cli, sandbox = _sandbox(changes=False)  # previews itself
    if cli.dry_run:
        cli.output.result({"dry_run": True, "order_id": order_id, "processor": processor})
        return
    payment = _call(sandbox.pay, order_id, processor=processor, method="PAYPAL" if wallet else "PAYMENT_CARD",
                    report_to_provider=not no_provider_report, drop_webhook=drop_webhook, duplicates=duplicates)
    cli.output.result(payment, human=f"{payment['id']} {payment['status']} on {payment['processor']['name']}")


@command(app, "refund")
def refund(payment_id: str, amount: int = typer.Option(None, "--amount")):
    """Refund a payment at the orchestrator (the provider emits payment_refunded)."""
    cli, sandbox = _sandbox()
    payment = _call(sandbox.refund, payment_id, amount)
    cli.output.result(payment, human=f"{payment_id} refunded {payment['processor']['amountRefunded']}")


@command(app, "instrument")
def instrument(customer_id: str, kind: str = typer.Option("PAYMENT_CARD", "--type", help="PAYMENT_CARD or PAYPAL."),
               expired: bool = typer.Option(False, "--expired"), deleted: bool = typer.Option(False, "--deleted"),
               default: bool = typer.Option(False, "--default")):
    """Vault an instrument for a customer (wallet-only customers, expired and deleted cards)."""
    cli, sandbox = _sandbox()
    cli.output.result(sandbox.add_instrument(customer_id, kind, expired=expired, deleted=deleted, default=default))


@command(app, "fault")
def fault(system: str = typer.Argument(..., help="provider or orchestrator"),
          kind: str = typer.Argument(..., help=", ".join(FAULT_KINDS)),
          path: str = typer.Option("", "--path", help="Only requests whose path contains this."),
          method: str = typer.Option("*", "--method"),
          count: int = typer.Option(1, "--count", help="How many requests; -1 for every one."),
          retry_after: float = typer.Option(None, "--retry-after"),
          delay: float = typer.Option(0.0, "--delay"),
          skip: int = typer.Option(0, "--skip", help="Let this many matching requests through first.")):
    """Inject a fault into the next matching requests."""
    from billingctl.domain.errors import InvalidInput

    cli, sandbox = _sandbox()
    if system not in ("provider", "orchestrator") or kind not in FAULT_KINDS:
        raise InvalidInput(f"system must be provider or orchestrator and kind one of {', '.join(FAULT_KINDS)}")
    fault_id = sandbox.store.add_fault(system, kind, method=method, path=path, count=count,
                                       retry_after=retry_after, delay=delay, skip=skip)
    cli.output.result({"fault_id": fault_id, "system": system, "kind": kind, "count": count})


@command(app, "webhooks")
def webhooks(action: str = typer.Argument(..., help="hold or release"),
             order: str = typer.Option("reverse", "--order", help="release order: reverse or fifo")):
    """Hold webhook deliveries, then release them out of order (reordered delivery)."""
    from billingctl.domain.errors import InvalidInput

    cli, sandbox = _sandbox()
    if action == "hold":
        sandbox.hold_webhooks(True)
        cli.output.result({"holding": True})
    elif action == "release" and order in ("reverse", "fifo"):
        statuses = sandbox.release_webhooks(order)
        cli.output.result({"released": len(statuses), "statuses": statuses})
    else:
        raise InvalidInput("action must be hold or release, and --order reverse or fifo")


@command(app, "clear-faults")
def clear_faults():
    """Remove every injected fault."""
    cli, sandbox = _sandbox()
    sandbox.store.clear_faults()
    cli.output.result({"cleared": True})


@command(app, "clock")
def clock(advance: float = typer.Argument(0.0, help="Seconds to move the sandbox clock forward.")):
    """Show or move the sandbox's clock (moved, pending refunds reach their final state and the webhook
    retries that fall due are sent)."""
    cli, sandbox = _sandbox(changes=bool(advance))
    now = sandbox.store.advance_clock(advance) if advance else sandbox.store.now()
    refunds = sandbox.finish_refunds() if advance else []
    redelivered = sandbox.redeliver_due() if advance else []
    cli.output.result({"now": now, "refunds_finished": len(refunds), "webhooks_redelivered": len(redelivered)})


@command(app, "backdating")
def backdating(state: Literal["on", "off"] = typer.Argument(..., help="on or off")):
    """The provider site's backdating setting (off by default, as at the provider): with it off, a start
    date more than a minute in the past is refused."""
    cli, sandbox = _sandbox()
    sandbox.store.set_meta("backdating", state == "on")
    cli.output.result({"backdating": state})


@command(app, "async-charges")
def async_charges(status: str = typer.Argument(..., help="PENDING, AUTHORIZED, SETTLING, PARTIALLY_SETTLED, or off")):
    """Merchant-initiated charges answer this non-final status and stay in flight until `finish`."""
    cli, sandbox = _sandbox()
    _call(sandbox.async_charges, None if status.lower() == "off" else status.upper())
    cli.output.result({"async_charges": None if status.lower() == "off" else status.upper()})


@command(app, "async-refunds")
def async_refunds(outcome: str = typer.Argument(..., help="SETTLED, FAILED, or off")):
    """Refunds answer PENDING and reach this final state when the sandbox's clock next moves
    (`sandbox clock`), reported by PAYMENT.REFUND; off: refunds settle at once."""
    cli, sandbox = _sandbox()
    _call(sandbox.async_refunds, None if outcome.lower() == "off" else outcome.upper())
    cli.output.result({"async_refunds": None if outcome.lower() == "off" else outcome.upper()})


@command(app, "finish")
def finish(payment_id: str, decline: bool = typer.Option(False, "--decline", help="Decline instead of settling."),
           fail: bool = typer.Option(False, "--fail", help="FAILED (a processor error) instead of settling."),
           captured: int = typer.Option(None, "--captured", help="Capture only this much: PARTIALLY_SETTLED."),
           drop_webhook: bool = typer.Option(False, "--drop-webhook", help="Do not deliver PAYMENT.STATUS.")):
    """An in-flight payment settles (in full or in part), is declined or fails; PAYMENT.STATUS follows."""
    cli, sandbox = _sandbox()
    payment = _call(sandbox.finish_payment, payment_id, settle=not (decline or fail), drop_webhook=drop_webhook,
                    captured=captured, failed=fail)
    cli.output.result(payment, human=f"{payment_id} {payment['status']}")


@command(app, "capture")
def capture(payment_id: str,
            amount: int = typer.Option(None, "--amount", help="Less than authorized: a partial capture."),
            not_final: bool = typer.Option(False, "--not-final", help="A later capture may take the rest.")):
    """Capture an AUTHORIZED payment, or the rest of one captured in part by a capture that was not final
    (the orchestrator's capture call)."""
    cli, sandbox = _sandbox()
    payment = _call(sandbox.capture, payment_id, amount, not not_final)
    cli.output.result(payment, human=f"{payment_id} {payment['status']}")


@command(app, "cancel-payment")
def cancel_payment(payment_id: str):
    """Void a PENDING or AUTHORIZED payment (the orchestrator's cancel call): CANCELLED."""
    cli, sandbox = _sandbox()
    payment = _call(sandbox.cancel_payment, payment_id)
    cli.output.result(payment, human=f"{payment_id} {payment['status']}")


@command(app, "dispute-status")
def dispute_status(payment_id: str, status: str = typer.Argument(..., help="OPEN, ACCEPTED, CHALLENGED, EXPIRED, "
                                                                          "CANCELLED, WON or LOST"),
                   kind: str = typer.Option("DISPUTE", "--type", help="RETRIEVAL, DISPUTE or PREARBITRATION"),
                   dispute_id: str = typer.Option(None, "--dispute-id", help="An existing dispute's id.")):
    """DISPUTE.STATUS (Primer's unified dispute lifecycle), signed, to the disputes receiver."""
    cli, sandbox = _sandbox()
    result = _call(sandbox.dispute_status, payment_id, status.upper(), kind=kind.upper(), dispute_id=dispute_id)
    cli.output.result(result, human=f"dispute {result['dispute']['processorDisputeId']} on {payment_id} "
                                    f"{result['dispute']['type']}/{result['dispute']['status']}: "
                                    f"delivered {result['delivered']}")


@command(app, "dispute")
def dispute(payment_id: str):
    """Open a chargeback: DISPUTE.OPENED in the orchestrator's flat shape, signed, to the disputes receiver."""
    cli, sandbox = _sandbox()
    result = _call(sandbox.open_dispute, payment_id)
    cli.output.result(result, human=f"dispute {result['dispute']['processorDisputeId']} on {payment_id}: "
                                    f"delivered {result['delivered']}")
