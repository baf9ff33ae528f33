"""Runners execute a job; they hold no feature logic (that lives in ``operators``)."""

from streamflow.runners.device import DeviceRunner
from streamflow.summary import RunSummary

__all__ = ["DeviceRunner", "RunSummary"]
