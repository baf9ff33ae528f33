"""streamflow: write a user-behaviour feature pipeline once in Python, run it where the data is.

Example:
    >>> from streamflow import Job, Task
    >>> from operators import Aggregate, Count
    >>> job = Job("demo", [Task("favs", ["fav"], [Aggregate(n=Count())], input="recent")])
"""

from streamflow.events import PAGE_ENTER, PAGE_EXIT, Event, Rejected, TimestampGuard
from streamflow.job import Job, JobLoadError, Task, load_job
from streamflow.sequences import PageVisit, UserSequence
from streamflow.sources import JsonLinesSource, TaobaoBehaviorSource, open_source
from streamflow.trie import WILDCARD, TriggerTrie

__all__ = [
    "PAGE_ENTER", "PAGE_EXIT", "WILDCARD", "Event", "Job", "JobLoadError", "JsonLinesSource", "PageVisit",
    "Rejected", "Task", "TaobaoBehaviorSource", "TimestampGuard", "TriggerTrie", "UserSequence",
    "load_job", "open_source",
]
