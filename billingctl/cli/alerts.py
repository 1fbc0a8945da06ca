"""`billingctl alerts`: send, list and deliver chat alerts and notifications (the outbox)."""

from __future__ import annotations

from typing import Literal

import typer

from billingctl.cli.context import command, exit_if_partial, get_ctx, noun

app = noun("Chat alerts, user notifications and analytics events (the outbox).")


@command(app, "send")
def send(message: str = typer.Argument(..., help="Alert text."),
         user: str = typer.Option(None, "--user", help="Notify this user instead of the chat channel."),
         key: str = typer.Option(None, "--key", help="Dedupe key: a second send with the same key is a no-op.")):
    """Queue an alert (or a user notification) and try to deliver it."""
    from billingctl.services.alerts import send_alert

    cli = get_ctx()
    if cli.dry_run:
        cli.output.result({"dry_run": True, "sink": "notify" if user else "chat", "message": message})
        return
    result = send_alert(cli.container, message, user_id=user, dedupe_key=key)
    cli.output.result(result, human=f"queued={result['queued']} delivery={result['delivery']}")


@command(app, "list")
def list_(state: Literal["pending", "sending", "delivered"] = typer.Option(
              None, "--state", "--status", help="Where the message stands (--state, as in every list; "
                                                "--status is the older spelling).", metavar="STATE"),
          limit: int = typer.Option(50, "--limit")):
    """Show the outbox, newest first."""
    from billingctl.services.alerts import list_outbox

    cli = get_ctx()
    rows = list_outbox(cli.container, state, limit)
    cli.output.table([{**r, "payload": (r["payload"].get("text") or r["payload"].get("message") or r["payload"])}
                      for r in rows], ["id", "sink", "status", "attempts", "dedupe_key", "payload", "last_error"],
                     title="outbox", data=rows)


@command(app, "deliver")
def deliver():
    """Deliver every message that is due (the job runs this)."""
    from billingctl.services.alerts import deliver_outbox

    cli = get_ctx()
    if cli.dry_run:
        from billingctl.services.alerts import list_outbox

        due = [r["dedupe_key"] for r in list_outbox(cli.container, "pending", 1000)]
        cli.output.result({"dry_run": True, "pending": due})
        return
    result = deliver_outbox(cli.container)
    cli.output.result(result)
    exit_if_partial(result)
