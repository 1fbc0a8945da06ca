"""`billingctl products list`: plans from the provider's catalog."""

from __future__ import annotations

from billingctl.cli.context import command, get_ctx, noun

app = noun("Plans from the provider's catalog.")


@command(app, "list")
def products_list():
    """The plans a user can buy (the same cached catalog checkout uses)."""
    from billingctl.services.catalog import product_view, products

    cli = get_ctx()
    cli.output.table([product_view(p) for p in products(cli.container)], title="products")
