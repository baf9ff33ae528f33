"""Per-user activity in sliding event-time windows: a stream task, no trigger.

Every interaction (fav, cart, buy) and page view of a user is counted in one-minute windows
sliding every 20 seconds. Events may arrive up to 5 seconds out of order; a window that has fired
still takes events up to 10 seconds late (and fires again with the update); anything later goes to
the ``late_events`` table.

Run it:  streamflow run jobs/activity_windows.py --events tests/data/activity.jsonl
"""

from operators import Aggregate, Count, CountDistinct, Filter, KeyBy, Map, Max, Sum, TimeWindow
from streamflow import Job, Task

WEIGHTS = {"page_enter": 1, "fav": 2, "cart": 3, "buy": 5}


def _interaction(event) -> dict:
    return {"user_id": event.user_id, "kind": event.event_id, "item_id": event["item_id"],
            "ts": event.ts, "weight": WEIGHTS[event.event_id]}


activity = Task(
    name="activity",
    trigger=None,
    input="stream",
    pipeline=[
        Filter(lambda event: event.event_id in WEIGHTS),  # page exits and reloads are not activity
        Map(_interaction),
        KeyBy("user_id"),
        TimeWindow(60, slide=20, out_of_orderness=5, allowed_lateness=10),
        Aggregate(events=Count(), items=CountDistinct("item_id"), score=Sum("weight"),
                  buys=Count(where=lambda row: row["kind"] == "buy"), last_ts=Max("ts")),
        Map(lambda row: {**row, "score_per_event": round(row["score"] / row["events"], 6)}),
        Filter(lambda row: row["events"] >= 1),
    ],
)

job = Job("activity_windows", [activity], description="Per-user activity in sliding event-time windows")
