"""The ``sessions`` task of ``jobs/sessions.py`` alone, as a job file (``streamflow run`` takes a job file):
what ``bench.peers`` runs as its ``sessions`` job against :mod:`bench.bytewax_sessions`.

Run it:  streamflow run bench/sessions_job.py --events EVENTS.csv --mode streaming
"""

from jobs.sessions import sessions
from streamflow import Job

job = Job("sessions", [sessions], description="The sessions task of jobs/sessions.py alone")
