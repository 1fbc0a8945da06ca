"""The baseline for the webhook benchmark: a Flask hello world."""

from flask import Flask

app = Flask("hello")


@app.post("/webhooks/orchestrator/payments")
def hello():
    return {"ok": True}
