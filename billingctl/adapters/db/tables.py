"""SQLAlchemy tables. The spec's resources keep its field names exactly; our own tables carry the
invariants (unique keys) that make payments, credits, events and alerts happen at most once."""

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)

from billingctl.adapters.db.types import UTCDateTime

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
metadata = MetaData(naming_convention=NAMING)


def _ts(name: str, nullable: bool = True, **kw) -> Column:
    return Column(name, UTCDateTime(), nullable=nullable, **kw)


# ---- the spec's resources (section 2) ---------------------------------------------------------

users = Table(
    "users",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("email", String(320)),
    _ts("created_at", nullable=False),
    Column("credits", BigInteger, nullable=False, server_default=text("0")),
    _ts("frozen_at"),
    Column("frozen_reason", Text),
    # The user's last credit-ledger row when the freeze took effect (0: none): a credit written after the
    # freeze has a greater id, whatever the clocks of the hosts that wrote them said (decision 177).
    Column("frozen_ledger_id", BigInteger),
    Column("idv_status", String(32)),
    _ts("idv_updated_at"),
    _ts("deleted_at"),
)

# The lane assignment ("user credits record"). Unlocked = NULL or empty string.
user_credits = Table(
    "user_credits",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("user_id", String(64), ForeignKey("users.id"), nullable=False),
    Column("sfw_processor", String(64)),
    Column("nsfw_processor", String(64)),
    Column("nsfw_processor_mid", String(128)),
    _ts("created_at", nullable=False),
    _ts("deleted_at"),
    # One live row per user; soft-deleted rows may pile up beside it.
    Index(
        "uq_user_credits_live_user",
        "user_id",
        unique=True,
        postgresql_where=text("deleted_at IS NULL"),
        sqlite_where=text("deleted_at IS NULL"),
    ),
)

subscription = Table(
    "subscription",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("status", String(32), nullable=False),
    _ts("start_date"),
    _ts("current_term_end"),
    Column("customer_id", String(64), nullable=False, index=True),
    _ts("created_at", nullable=False),
    Column("coupon_ids", JSON, nullable=False, default=list),
    Column("item_price_id", String(128)),
    Column("lane", String(8)),
    # Set when a purchase exists but the provider's activation (term-end change) has not succeeded.
    _ts("activation_pending_since"),
    Column("activation_error", Text),
    _ts("provider_updated_at"),
    _ts("synced_at"),
    # The provider's resource_version (milliseconds) of the copy applied last: a copy is applied only
    # when it is not older (its reference orders updates by it; updated_at has whole seconds).
    Column("provider_resource_version", BigInteger),
    # When we learnt the provider no longer holds it (deleted there: its event, or a read answered not
    # found): a deleted subscription has no newer copy, so every copy read after is older news (decision 223).
    _ts("deleted_at"),
)

invoice = Table(
    "invoice",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("subscription_id", String(64), index=True),
    Column("customer_id", String(64), index=True),
    Column("total_amount", BigInteger),
    Column("currency_code", String(3)),
    _ts("paid_at"),
    Column("status", String(32)),
    _ts("created_at", nullable=False),
    # The provider's resource_version of the copy applied last (decision 117), like the subscription's.
    Column("provider_resource_version", BigInteger),
    _ts("deleted_at"),  # the provider deleted it (its `deleted` flag): owed by nobody (decision 201)
    # The term its plan line bills (the provider's line_items[].date_from, date_to; decision 204).
    _ts("term_start"),
    _ts("term_end"),
)

transaction = Table(
    "transaction",
    metadata,
    Column("transaction_id", String(64), primary_key=True),
    Column("amount", BigInteger, nullable=False),
    Column("currency_code", String(3)),
    Column("status", String(32), nullable=False),
    _ts("created_at", nullable=False, index=True),  # the velocity watch reads the last minute
    Column("customer_id", String(64), index=True),
    Column("invoice_id", String(64)),
    Column("subscription_id", String(64)),
    Column("processor", String(64)),
    Column("processor_merchant_id", String(128)),
    _ts("updated_at"),
)

purchase = Table(
    "purchase",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("invoice_id", String(64), index=True),  # "already paid" and reconcile
    # The orchestrator's payment id; the idempotency key of payment recording.
    Column("transaction_id", String(64), nullable=False, unique=True),
    Column("subscription_id", String(64), nullable=False, index=True),
    Column("user_id", String(64), ForeignKey("users.id"), nullable=False, index=True),
    Column("item_price_id", String(128)),
    Column("amount", BigInteger),
    Column("currency_code", String(3)),
    Column("credits", BigInteger, nullable=False, server_default=text("0")),
    Column("processor", String(64)),
    Column("recorded_via", String(32)),
    _ts("settled_at"),
    _ts("created_at", nullable=False),
    # When the payment was recorded on the provider's invoice (NULL: still to do).
    _ts("provider_recorded_at"),
    # A renewal's payment: until then its record on the invoice is the orchestrator's workflow's, confirmed
    # by the provider's payment_succeeded event; after it, the activations job records it (issue 39 item 1).
    _ts("confirm_after"),
    # Set when the follow-up ended without the provider's invoice (its invoice was voided, or the payment
    # was refunded as a duplicate or an orphan): nothing is recorded at the provider, its credits are reversed.
    Column("closed_reason", String(32)),
    _ts("closed_at"),
    # Of the payment, what was given back because its invoice was part-paid at the provider meanwhile (a
    # cheque): it pays the rest of the invoice there, and that refund takes back no credits (decision 180).
    Column("returned_excess", BigInteger, nullable=False, server_default=text("0")),
    # Reconcile's window (decision 133): purchases made, and follow-ups still open, since a time.
    Index("ix_purchase_created_at", "created_at"),
    Index("ix_purchase_provider_recorded_at", "provider_recorded_at"),
    Index("ix_purchase_closed_at", "closed_at", postgresql_where=text("closed_at IS NOT NULL"),
          sqlite_where=text("closed_at IS NOT NULL")),
    Index("ix_purchase_open_followup", "created_at",
          postgresql_where=text("provider_recorded_at IS NULL AND closed_at IS NULL"),
          sqlite_where=text("provider_recorded_at IS NULL AND closed_at IS NULL")),
)

fraud_event = Table(
    "fraud_event",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("user_id", String(64), nullable=False),
    Column("event_type", String(32), nullable=False),
    _ts("created_at", nullable=False),
    Column("metadata", JSON, nullable=False, default=dict),
    Column("dedupe_key", String(200), unique=True),
    Index("ix_fraud_event_user_type_created", "user_id", "event_type", "created_at"),
)

dunning_attempt = Table(
    "dunning_attempt",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("invoice_id", String(64), nullable=False, index=True),
    Column("subscription_id", String(64)),
    Column("user_id", String(64)),
    _ts("created_at", nullable=False),
    Column("status", String(32), nullable=False),
    Column("decline_code", String(64)),
    Column("payment_id", String(64), index=True),  # a settle report ends its pending row
    Column("attempt_no", Integer, nullable=False, server_default=text("0")),
    Column("lane", String(8)),
    Column("processor", String(64)),
    Column("amount", BigInteger),
    _ts("next_attempt_at"),
    # A pending row's end: set once, by a conditional update, by whichever path saw the charge end first;
    # the outcome row follows it in the same transaction (domain.lifecycle.DUNNING).
    _ts("resolved_at"),
)

# Disputes at the orchestrator (Primer's DISPUTE.OPENED and DISPUTE.STATUS), one row per processor dispute
# id; `state` follows domain.lifecycle.DISPUTE, `kind` and `status` are the orchestrator's own words.
dispute = Table(
    "dispute",
    metadata,
    Column("dispute_id", String(128), primary_key=True),
    Column("payment_id", String(64), nullable=False, index=True),
    Column("user_id", String(64), index=True),
    Column("order_id", String(64)),
    Column("kind", String(16)),
    Column("status", String(16)),
    Column("state", String(16), nullable=False),
    Column("amount", BigInteger),
    Column("currency_code", String(3)),
    Column("processor", String(64)),
    _ts("created_at", nullable=False),
    _ts("updated_at", nullable=False),
    _ts("decided_at"),
)

event_poller_state = Table(
    "event_poller_state",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    _ts("created_at", nullable=False, index=True),
    Column("events_seen", Integer, nullable=False, server_default=text("0")),
    Column("events_processed", Integer, nullable=False, server_default=text("0")),
    Column("events_failed", Integer, nullable=False, server_default=text("0")),
    Column("cursor", String(128)),
    Column("error", Text),
)

login_attempt = Table(
    "login_attempt",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("user_id", String(64)),
    Column("ip_address", String(64)),
    _ts("created_at", nullable=False),
)

# ---- the project's own tables (DESIGN section 6) --------------------------------------------

# Every change of users.credits is one ledger row; the unique source key makes each credit and
# each refund reversal happen at most once. users.credits always equals the sum of amounts.
credit_ledger = Table(
    "credit_ledger",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("user_id", String(64), ForeignKey("users.id"), nullable=False, index=True),
    Column("amount", BigInteger, nullable=False),
    Column("source_key", String(200), nullable=False, unique=True),
    Column("reason", String(32), nullable=False),
    Column("payment_id", String(64), index=True),  # a refund's reversal sums the payment's rows
    _ts("created_at", nullable=False, index=True),  # reconcile's window (decision 133)
)

# One inbox for events from every source (webhooks and pollers), processed exactly once.
event_inbox = Table(
    "event_inbox",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("source", String(32), nullable=False),
    Column("event_id", String(128), nullable=False),
    Column("event_type", String(64), nullable=False),
    _ts("occurred_at"),
    Column("payload", JSON, nullable=False),
    Column("status", String(16), nullable=False, server_default=text("'pending'")),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("last_error", Text),
    # How many times the event arrived, and by which paths (webhook, poller, replay).
    Column("deliveries", Integer, nullable=False, server_default=text("0")),
    Column("seen_by", JSON, nullable=False, default=list),
    _ts("received_at", nullable=False),
    _ts("processed_at"),
    UniqueConstraint("source", "event_id"),
    Index("ix_event_inbox_status", "status"),
)

checkout_session = Table(
    "checkout_session",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("user_id", String(64), ForeignKey("users.id"), nullable=False, index=True),
    Column("subscription_id", String(64), nullable=False, index=True),
    # The invoice the checkout's payment is recorded on: a future subscription has none until it starts,
    # so this is NULL until activation starts it (rows before 0002 hold their order id here).
    Column("invoice_id", String(64), unique=True),
    # The orderId given to the orchestrator and held by the front end (the subscription id).
    Column("order_id", String(64), unique=True),
    Column("item_price_id", String(128), nullable=False),
    Column("lane", String(8), nullable=False),
    Column("amount", BigInteger, nullable=False),
    Column("currency_code", String(3), nullable=False),
    Column("client_token", Text),
    _ts("expires_at"),
    Column("status", String(16), nullable=False),
    _ts("created_at", nullable=False),
)

orphan_recovery = Table(
    "orphan_recovery",
    metadata,
    Column("payment_id", String(64), primary_key=True),
    Column("user_id", String(64)),
    Column("subscription_id", String(64)),
    Column("item_price_id", String(128)),
    Column("amount", BigInteger),
    Column("currency_code", String(3)),
    Column("status", String(24), nullable=False),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    _ts("next_attempt_at"),
    Column("last_error", Text),
    _ts("settled_at"),
    _ts("created_at", nullable=False),
    _ts("updated_at", nullable=False),
    Column("resolution", String(32)),
    Column("resolved_by", String(64)),
    # A payment a person kept pays its order: recording reads it for each new payment (decision 253).
    Index("ix_orphan_recovery_handled", "subscription_id", postgresql_where=text("resolution = 'handled'"),
          sqlite_where=text("resolution = 'handled'")),
)

# Alerts, user notifications and analytics events wait here until their sink accepts them.
alert_outbox = Table(
    "alert_outbox",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("sink", String(16), nullable=False),
    Column("dedupe_key", String(200), nullable=False, unique=True),
    Column("payload", JSON, nullable=False),
    Column("status", String(16), nullable=False, server_default=text("'pending'")),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    _ts("next_attempt_at"),
    Column("last_error", Text),
    _ts("created_at", nullable=False),
    _ts("delivered_at"),
    Index("ix_alert_outbox_status", "status"),
)

job_lease = Table(
    "job_lease",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("holder", String(128)),
    _ts("acquired_at"),
    _ts("expires_at"),
    _ts("last_success_at"),
    _ts("last_failure_at"),
    Column("last_error", Text),
)

# Named cursors of the pollers (provider events, settled payments).
poller_cursor = Table(
    "poller_cursor",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("value", String(256)),
    _ts("updated_at", nullable=False),
)

audit_log = Table(
    "audit_log",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("actor", String(128), nullable=False),
    Column("action", String(64), nullable=False),
    Column("target", String(128), nullable=False),
    Column("reason", Text),
    Column("details", JSON, nullable=False, default=dict),
    _ts("created_at", nullable=False),
)

# A reconcile violation a person has judged (`billingctl reconcile ack`): reported, no longer counted. One
# row per check and subject (the violation's first id); `billingctl reconcile ack --remove` deletes it.
reconcile_ack = Table(
    "reconcile_ack",
    metadata,
    Column("check_name", String(64), primary_key=True),
    Column("subject", String(200), primary_key=True),
    Column("reason", Text, nullable=False),
    Column("actor", String(128), nullable=False),
    _ts("created_at", nullable=False),
)
