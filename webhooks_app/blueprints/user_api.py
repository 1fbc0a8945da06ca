"""The session-authenticated user API. Identity comes only from the session; a user_id in the body
or the query is never read."""

from __future__ import annotations

from flask import Blueprint, current_app, g, jsonify, request

from billingctl.domain.errors import InvalidInput
from webhooks_app.session import session_required

bp = Blueprint("user_api", __name__, url_prefix="/api")


def container():
    return current_app.extensions["billing"]


@bp.get("/billing/products")
@session_required
def products():
    from billingctl.services.catalog import product_view
    from billingctl.services.catalog import products as catalog_products

    return jsonify({"products": [product_view(p) for p in catalog_products(container())]})


@bp.post("/billing/checkout")
@session_required
def checkout():
    from billingctl.services.checkout import create_checkout

    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        raise InvalidInput("a JSON object body is required")
    # Only item_price_id is read: amounts, user ids and processor fields from the client have no effect.
    result = create_checkout(container(), g.user_id, body.get("item_price_id"),
                             risky_actions=request.headers.get("x-risky-actions"))
    return jsonify({"order_id": result["order_id"], "client_token": result["client_token"],
                    "amount": result["amount"], "currency_code": result["currency_code"],
                    "subscription_id": result["subscription_id"]}), 201


@bp.get("/checkout/status")
@session_required
def checkout_status():
    from billingctl.services.checkout import checkout_status as status

    return jsonify(status(container(), g.user_id, request.args.get("order_id", "")))


@bp.get("/subscriptions/<subscription_id>")
@session_required
def subscription(subscription_id):
    from billingctl.services.subscriptions import get_for_user

    return jsonify(get_for_user(container(), g.user_id, subscription_id))


def register(app) -> None:
    app.register_blueprint(bp)
