"""The release side of deployment: the release server, staged release, the publisher's tools (see the package above)."""
