"""The baseline for the webhook benchmark: the least a correct receiver of a duplicate must do, in the same
Flask under the same gunicorn. It checks the HMAC signature over the raw body in constant time, parses the
JSON and reads the event's inbox row with one psycopg query (one connection per worker), then answers."""

import base64
import hashlib
import hmac
import json
import os

import psycopg
from flask import Flask, abort, jsonify, request

app = Flask("minimal")
SECRET = os.environ["BENCH_WEBHOOK_SECRET"].encode()
URL = os.environ["BILLING_DATABASE_URL"].replace("postgresql+psycopg://", "postgresql://")
_conn = None


def _db():
    global _conn
    if _conn is None or _conn.closed:
        _conn = psycopg.connect(URL, autocommit=True)
    return _conn


@app.post("/webhooks/orchestrator/payments")
def receive():
    raw = request.get_data(cache=False)
    expected = base64.b64encode(hmac.new(SECRET, raw, hashlib.sha256).digest()).decode()
    if not hmac.compare_digest(expected, request.headers.get("X-Signature-Primary", "")):
        abort(401)
    body = json.loads(raw)
    payment = body["payment"]
    event_id = f"{body['eventType']}:{payment['id']}:{payment.get('status')}"
    row = _db().execute("SELECT status FROM event_inbox WHERE source = 'orchestrator' AND event_id = %s",
                        (event_id,)).fetchone()
    return jsonify({"event_id": event_id, "outcome": "duplicate" if row else "new"})
