"""Stream tasks on session windows, count windows and a user's own keyed process function.

- ``sessions``: a user's shopping sessions (no activity for 30 s ends one), with what happened in each.
- ``every_3_items``: for every 3 items a user interacts with, how many of them were bought.
- ``cart_abandoned``: a keyed process function with state and timers: a cart not followed by a buy
  within 60 s (event time) is reported once, when the watermark passes the deadline; state expires
  after an hour of stream time without a cart.

Run it:  streamflow run jobs/sessions.py --events tests/data/activity.jsonl
"""

from operators import (
    Aggregate,
    Count,
    CountWindow,
    Filter,
    KeyBy,
    KeyedProcessFunction,
    Map,
    Max,
    Min,
    Process,
    SessionWindow,
    ValueStateDescriptor,
)
from streamflow import Job, Task

INTERACTIONS = ("fav", "cart", "buy")


def _interaction(event) -> dict:
    return {"user_id": event.user_id, "kind": event.event_id, "item_id": event["item_id"], "ts": event.ts}


class CartAbandoned(KeyedProcessFunction):
    """Reports a cart that no buy followed within ``timeout_s`` seconds of event time."""

    def __init__(self, timeout_s: float = 60.0):
        self.timeout_ms = round(timeout_s * 1000)

    def open(self, ctx):
        self.cart = ctx.get_state(ValueStateDescriptor("cart", ttl_s=3600))  # (item_id, ts_ms) of the open cart

    def on_event(self, event, ctx):
        if event.event_id == "cart":
            self.cart.update((event["item_id"], ctx.timestamp))
            ctx.register_event_time_timer(ctx.timestamp + self.timeout_ms)
        elif event.event_id == "buy":
            self.cart.clear()

    def on_timer(self, time_ms, ctx):
        cart = self.cart.value()
        if cart is not None and cart[1] + self.timeout_ms == time_ms:
            ctx.emit({"user_id": ctx.key, "item_id": cart[0], "cart_ts": cart[1] / 1000})
            self.cart.clear()


sessions = Task("sessions", None, input="stream", pipeline=[
    Filter(lambda event: event.event_id in INTERACTIONS or event.event_id == "page_enter"),
    KeyBy("user_id"),
    SessionWindow(30, out_of_orderness=5),
    Aggregate(events=Count(), buys=Count(where=lambda e: e.event_id == "buy"), first_ts=Min("ts"), last_ts=Max("ts")),
])

every_3_items = Task("every_3_items", None, input="stream", pipeline=[
    Filter(lambda event: event.event_id in INTERACTIONS),
    Map(_interaction),
    KeyBy("user_id"),
    CountWindow(3),
    Aggregate(buys=Count(where=lambda row: row["kind"] == "buy"), last_ts=Max("ts")),
])

cart_abandoned = Task("cart_abandoned", None, input="stream", pipeline=[
    KeyBy("user_id"),
    Process(CartAbandoned(timeout_s=60), out_of_orderness=5),
])

job = Job("sessions", [sessions, every_3_items, cart_abandoned],
          description="Session windows, count windows and a keyed process function with timers")
