"""`billingctl checkout cleanup`, `billingctl quota show`, `billingctl products list`."""

from __future__ import annotations

import typer

from billingctl.cli.context import command, get_ctx

checkout_app = typer.Typer(help="Checkouts.",
                  no_args_is_help=True, rich_markup_mode=None)
quota_app = typer.Typer(help="The NSFW authorization-attempt quota.",
                  no_args_is_help=True, rich_markup_mode=None)
products_app = typer.Typer(help="Plans from the provider's catalog.",
                  no_args_is_help=True, rich_markup_mode=None)


def register(app: typer.Typer) -> None:
    app.add_typer(checkout_app, name="checkout")
    app.add_typer(quota_app, name="quota")
    app.add_typer(products_app, name="products")


@command(checkout_app, "cleanup")
def cleanup():
    """Cancel expired pending checkouts older than a day (never one with a purchase)."""
    from billingctl.cli.exitcodes import PARTIAL
    from billingctl.services.checkout import cleanup_expired

    cli = get_ctx()
    result = cleanup_expired(cli.container, dry_run=cli.dry_run)
    cli.output.result(result)
    if result.get("failed"):
        raise typer.Exit(PARTIAL)


@command(quota_app, "show")
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


@command(products_app, "list")
def products_list():
    """The plans a user can buy (the same cached catalog checkout uses)."""
    from billingctl.services.catalog import product_view, products

    cli = get_ctx()
    cli.output.table([product_view(p) for p in products(cli.container)], title="products")
