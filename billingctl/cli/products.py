"""`billingctl products list`: plans from the provider's catalog."""

from __future__ import annotations

import typer

from billingctl.cli.context import command, get_ctx

app = typer.Typer(help="Plans from the provider's catalog.",
                  no_args_is_help=True, rich_markup_mode=None)



@command(app, "list")
def products_list():
    """The plans a user can buy (the same cached catalog checkout uses)."""
    from billingctl.services.catalog import product_view, products

    cli = get_ctx()
    cli.output.table([product_view(p) for p in products(cli.container)], title="products")
