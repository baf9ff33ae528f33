"""Item page-view (IPV) features: what the user did between entering and leaving an item page.

The Walle paper's IPV feature. The trigger is the exit of the item detail page; the task folds the
page-level sequence (enter, reloads, fav/cart/buy clicks, exit) into one row per visit and keeps
only what a model needs: item and category, when the visit started, how long it lasted and how
often each behaviour happened. Fields repeated on every raw event (user, page and event ids,
per-event contents) and fields derivable from the row (exit time = trigger_ts, total events) are
dropped.

Run it:  streamflow run jobs/ipv.py --events jobs/data/taobao_user_behavior_10k.csv
"""

from operators import Aggregate, CountBy, First, Last, Map
from streamflow import Job, Task


def _ipv_row(visit: dict) -> dict:
    counts = visit["events"]
    return {
        "item_id": visit["item_id"],
        "category_id": visit["category_id"],
        "enter_ts": visit["enter_ts"],
        "dwell_s": visit["exit_ts"] - visit["enter_ts"],
        "n_reload": counts.get("pv", 0),
        "n_fav": counts.get("fav", 0),
        "n_cart": counts.get("cart", 0),
        "n_buy": counts.get("buy", 0),
    }


ipv = Task(
    name="ipv",
    trigger=["item"],  # a page id as trigger: the item page was just exited
    input="page",      # the events from entering that page to leaving it, in time order
    pipeline=[
        Aggregate(
            item_id=First("item_id"),
            category_id=First("category_id"),
            enter_ts=First("ts"),
            exit_ts=Last("ts"),
            events=CountBy("event_id"),
        ),
        Map(_ipv_row),
    ],
)

job = Job("ipv", [ipv], description="Item page-view features (Walle IPV) from app events")
