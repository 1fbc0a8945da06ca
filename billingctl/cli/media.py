"""`billingctl media sign|verify`: signed media URLs the edge WAF accepts."""

from __future__ import annotations

import time

import typer

from billingctl.cli.context import command, get_ctx, noun

app = noun("Signed media URLs.")


def _secret() -> str:
    from billingctl.domain.errors import ConfigError

    secret = get_ctx().container.settings.secret("media_signing_secret")
    if not secret:
        raise ConfigError("BILLING_MEDIA_SIGNING_SECRET is not set")
    return secret


@command(app, "sign")
def sign(path: str, at: int = typer.Option(None, "--at", help="Unix time to sign at (default: now).")):
    """Print the signed URL for PATH."""
    from billingctl.services.media import sign as sign_path

    cli = get_ctx()
    url = sign_path(_secret(), path, at if at is not None else int(time.time()))
    cli.output.result({"url": url}, human=url)


@command(app, "verify")
def verify(url: str, at: int = typer.Option(None, "--at", help="Unix time to verify at (default: now).")):
    """Exit 0 when URL is validly signed, 3 when not (and say why)."""
    from billingctl.cli.exitcodes import REFUSED
    from billingctl.services.media import verify as verify_url

    cli = get_ctx()
    verdict = verify_url(_secret(), url, at if at is not None else int(time.time()),
                         cli.container.settings.media_edge_ttl_seconds)
    cli.output.result({"valid": verdict.valid, "reason": verdict.reason}, human=verdict.reason)
    if not verdict.valid:
        cli.output.error(verdict.reason)
        raise typer.Exit(REFUSED)
