"""The device side of deployment: installed task versions, directives in, tasks hot-swapped (see the package above)."""
