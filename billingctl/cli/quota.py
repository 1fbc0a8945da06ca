"""`billingctl quota show`: the NSFW authorization-attempt quota."""

from __future__ import annotations

from billingctl.cli.context import command, get_ctx, noun

app = noun("The NSFW authorization-attempt quota.")


@command(app, "show")
def quota_show(user_id: str):
    """Used, limit, customer-initiated limit and when the next slot frees, per window."""
    from billingctl.services.fraud_quota import show

    cli = get_ctx()
    report = show(cli.container, user_id)
    if cli.json:
        cli.output.result(report)
        return
    cli.output.table([{**w, "next_slot_frees_at": w["next_slot_frees_at"] or "-"} for w in report["windows"]],
                     ["window", "used", "limit", "customer_limit", "next_slot_frees_at"],
                     title=f"authorization quota of {user_id} (enforced: {report['enforced']})")
