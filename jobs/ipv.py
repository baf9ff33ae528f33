"""Item page-view (IPV) features: what the user did between entering and leaving an item page.

The Walle paper's IPV feature. The trigger is the exit of the item detail page; the task folds the
page-level sequence (enter, reloads, fav/cart/buy clicks, exit) into one row per visit and keeps
only what a model needs: item and category, when the visit started, how long it lasted and how
often each behaviour happened. Fields repeated on every raw event (user, page and event ids,
per-event contents) and fields derivable from the row (exit time = trigger_ts, total events) are
dropped.

Run it:  streamflow run jobs/ipv.py --events jobs/data/taobao_user_behavior_10k.csv
"""

from operators import Aggregate, Count, First, Map, Max, Min
from streamflow import Job, Task


def _is(kind: str):
    return lambda event: event.event_id == kind


def _ipv_row(visit: dict) -> dict:
    return {
        "item_id": visit["item_id"],
        "category_id": visit["category_id"],
        "enter_ts": visit["enter_ts"],
        "dwell_s": visit["exit_ts"] - visit["enter_ts"],
        "n_reload": visit["n_reload"],
        "n_fav": visit["n_fav"],
        "n_cart": visit["n_cart"],
        "n_buy": visit["n_buy"],
    }


ipv = Task(
    name="ipv",
    trigger=["item"],  # a page id as trigger: the item page was just exited
    input="page",      # the events from entering that page to leaving it
    pipeline=[
        Aggregate(
            item_id=First("item_id"),
            category_id=First("category_id"),
            enter_ts=Min("ts"),
            exit_ts=Max("ts"),
            n_reload=Count(where=_is("pv")),
            n_fav=Count(where=_is("fav")),
            n_cart=Count(where=_is("cart")),
            n_buy=Count(where=_is("buy")),
        ),
        Map(_ipv_row),
    ],
)

job = Job("ipv", [ipv], description="Item page-view features (Walle IPV) from app events")
